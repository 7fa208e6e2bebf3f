"""CUDA C++ kernel sources, compiled at run time with NVRTC (see tileinfer.cuda.compiler)."""
