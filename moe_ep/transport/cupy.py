"""CuPy backend (work in progress)."""
import importlib.util

def cupy_available() -> bool:
  return importlib.util.find_spec("cupy") is not None

def require_cupy() -> None:
  if not cupy_available():
    raise ImportError("backend='cupy' needs CuPy: pip install 'moe_ep[cuda13]' (CUDA 13) "
                      "or 'moe_ep[cuda12]' (CUDA 12)")
