"""The host side of calls: the Python API (`api`: `Program`, `Kernel`), each workload's
call path (`forward`, `serving` for decode, `backward`), which check their arguments
(`calls`, `paged`) and plan their launches through one launcher (`launcher`), the torch
operator (`torch_op`) and timing helpers (`bench`).
"""
