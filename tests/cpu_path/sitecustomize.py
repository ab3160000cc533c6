"""Started in every Python process of the test suite (its folder is on PYTHONPATH): pins the CPU capability path
(cpu_path_pin.py says why and how) and changes how vLLM starts, never what it computes (vllm_startup.py)."""
import cpu_path_pin
import vllm_startup

cpu_path_pin.install()
vllm_startup.install()
