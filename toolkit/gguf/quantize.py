"""`python -m toolkit.gguf.quantize SRC DST TYPE`: llama.cpp's quantizer through llama-cpp-python, in a
process of its own (llama.cpp's native code stays out of the exporting process)."""

from __future__ import annotations

import ctypes
import sys

# llama.cpp's llama_ftype values (include/llama.h) for the types `ftkit export --gguf` offers.
FTYPES = {"q8_0": 7, "q4_k_m": 15, "q5_k_m": 17, "q6_k": 18}


def quantize(src: str, dst: str, kind: str) -> int:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[kind.lower()]
    return llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))


if __name__ == "__main__":
    sys.exit(quantize(*sys.argv[1:4]))
