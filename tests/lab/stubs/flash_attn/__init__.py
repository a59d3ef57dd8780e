"""Test-only stand-in for flash-attn, which needs CUDA to build (not installable on a CPU-only machine).

SkyRL's ``model_wrapper`` (imported by ``fsdp_strategy``) does ``from flash_attn.bert_padding import
pad_input, unpad_input`` at import time; the FSDP2 wrap path under test never calls them. The SkyRL tests put
this folder on their ranks' PYTHONPATH; it is not part of fsdp-compat.
"""
