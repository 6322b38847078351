"""ftkit: fine-tuning recipes and the small library they are built on."""

import logging

# bitsandbytes' CPU backend warns on import (peft and transformers import it whenever it is installed) that an
# optional kernel fetched from the hub is missing; ftkit never fetches code at run time and its 4-bit path
# runs without it. Set here, before anything imports bitsandbytes.
logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(
    lambda record: "gemm_4bit_forward" not in record.msg
)
