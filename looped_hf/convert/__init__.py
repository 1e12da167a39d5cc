"""Convert checkpoints written by other looped-LM code into Hub-ready looped_hf folders.

    looped-hf convert nanochat CKPT_DIR                 # the iso-depth study's checkpoints
    looped-hf convert huginn DIR                        # Huginn-0125 (huginn_raven)
    looped-hf convert retrofit DIR                      # retrofitted recurrence, Llama or OLMo variant
    looped-hf convert ouro DIR                          # Ouro-1.4B / 2.6B (ByteDance)
    looped-hf convert nanbeige DIR                      # Nanbeige4.2-3B
    looped-hf convert parcae DIR                        # Parcae (Sandy Research)

    looped-hf convert iquest DIR                        # IQuest-Coder-V1-Loop

One module per source format, as vLLM keeps one file per architecture: ``nanochat.py`` (the
study's looped-lm-scaling), ``huginn_raven.py`` (Huginn and the retrofitted-recurrence models),
``ouro.py`` (Ouro), ``nanbeige.py`` (Nanbeige4.2), ``iquest.py`` (IQuest LoopCoder), each only its mapping (names, reshapes, config keys); ``loader.py`` reads every
safetensors checkpoint folder (``Checkpoint``: config.json, the weights single or sharded, read
lazily, generation token ids, the tokenizer; everything checked, one policy for unknown config
keys), ``common.py`` holds the rest they share (the error type, the output folder's checks, the
model built from checked weights, the atomic folder write) and ``cli.py`` the command. Each writes a folder that
``AutoModelForCausalLM`` loads, with looped_hf installed or as remote code.
"""

from .cli import FORMATS, main
from .common import ConversionError, default_out
from .loader import Checkpoint
from .nanochat import (
    NanochatCheckpoint,
    convert_nanochat,
    flip_second_rotary_half,
    latest_nanochat_step,
    load_nanochat_checkpoint,
    load_study_tokenizer,
    nanochat_config,
    nanochat_key,
    nanochat_state_dict,
    nanochat_to_looped,
)

__all__ = [
    "FORMATS",
    "Checkpoint",
    "ConversionError",
    "NanochatCheckpoint",
    "convert_nanochat",
    "default_out",
    "flip_second_rotary_half",
    "latest_nanochat_step",
    "load_nanochat_checkpoint",
    "load_study_tokenizer",
    "main",
    "nanochat_config",
    "nanochat_key",
    "nanochat_state_dict",
    "nanochat_to_looped",
]
