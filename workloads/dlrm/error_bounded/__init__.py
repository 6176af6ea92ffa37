"""The error-bounded codec of DLRM's pooled-embedding all-to-all: its settings (config.py), the codec
that TorchRec calls (codec.py), its running totals (stats.py), the fast float32 path's fused kernels
(fast_kernels.py, fast_kernels.cpp) and the exact float64 path (exact_grid.py)."""
