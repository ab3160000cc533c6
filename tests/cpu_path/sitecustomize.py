"""Started in every Python process of the test suite (its folder is on PYTHONPATH): pins the CPU capability path
(cpu_path_pin.py says why and how)."""
import cpu_path_pin

cpu_path_pin.install()
