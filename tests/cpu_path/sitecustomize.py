"""Started in every Python process of the test suite (its folder is on PYTHONPATH): pins the CPU capability path
(cpu_path_pin.py says why and how) and parks vLLM's idle queue readers (vllm_readers.py)."""
import cpu_path_pin
import vllm_readers

cpu_path_pin.install()
vllm_readers.install()
