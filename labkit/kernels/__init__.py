"""labkit's kernels as source files: C++ for the CPU (`*.cpp`, `lanes.h`; `cpu.py` builds them
per CPU and says when they may run) and Triton for CUDA (`attention_triton.py`)."""
