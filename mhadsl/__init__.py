"""mhadsl: a compiler for attention kernels and their tile schedulers."""
__version__ = "0.1.0"
