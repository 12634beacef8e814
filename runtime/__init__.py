"""mhadsl.runtime: the CUDA driver side (context, module load, launch, memory), tensor interop
and the on-disk compile cache. Importing it needs no GPU; see `driver.gpu_available()`."""
