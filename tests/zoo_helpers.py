"""Shared by the zoo tests: each tiny native checkpoint in ``tests/fixtures/zoo`` converted by
``looped-hf convert`` as a user would run it, and a tokenizer for the converted folders.

The zoo fixtures have a 256-token vocabulary and no tokenizer files (their original code was run on
token ids); looped_hf's byte tokenizer has 258 tokens (256 bytes + EOS + PAD), which the models'
embeddings cannot hold. ``save_char_tokenizer`` writes a tokenizers-library tokenizer of exactly
``vocab_size`` tokens into a folder (a copy of a native checkpoint, whose tokenizer the converter
carries over, or a converted one), so eval and test-time read text through the folder's own
tokenizer, as they would for a released model's.
"""

from __future__ import annotations

from pathlib import Path

from conftest import fixture_path

ZOO = fixture_path("zoo")
#: fixture folder -> the ``looped-hf convert`` format a user names for it.
ZOO_FORMATS = {
    "huginn-tiny": "huginn",
    "retrofit-llama-tiny": "retrofit",
    "retrofit-olmo-tiny": "retrofit",
    "ouro-tiny": "ouro",
}
EOS, PAD, UNK = "<|endoftext|>", "<pad>", "<unk>"


def convert_zoo(name: str, out: Path, source: Path | None = None) -> Path:
    """``looped-hf convert FORMAT SOURCE --out OUT`` with fixture ``name``'s format; ``source``
    defaults to ``tests/fixtures/zoo/NAME`` (a copy can carry extra files, e.g. a tokenizer)."""
    from looped_hf.convert import main

    assert main([ZOO_FORMATS[name], str(source or ZOO / name), "--out", str(out)]) == 0
    return out


def save_char_tokenizer(folder: Path, vocab_size: int) -> None:
    """A character-level tokenizer of exactly ``vocab_size`` tokens, saved with ``save_pretrained``:
    UNK, EOS and PAD, then printable ASCII and as many Latin-1 letters as fill the vocabulary (a BPE
    with no merges splits text into single characters; any other character reads as UNK)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)] + [chr(c) for c in range(0xA1, 0x250)]
    symbols = [UNK, EOS, PAD] + chars[: vocab_size - 3]
    assert len(symbols) == vocab_size
    core = Tokenizer(models.BPE(vocab={s: i for i, s in enumerate(symbols)}, merges=[], unk_token=UNK))
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token=UNK, eos_token=EOS, pad_token=PAD, padding_side="left"
    )
    assert len(tokenizer) == vocab_size
    tokenizer.save_pretrained(folder)


def load_reference(folder: Path) -> dict:
    """A fixture's ``reference.npz`` (the original code's inputs and outputs) as torch tensors."""
    import numpy as np
    import torch

    with np.load(folder / "reference.npz") as arrays:
        return {name: torch.from_numpy(arrays[name]) for name in arrays.files}


def load_converted(folder: Path):
    """A converted folder through ``AutoModelForCausalLM`` in float32, eval mode; it must be looped_hf's."""
    import torch
    from transformers import AutoModelForCausalLM

    from looped_hf import LoopedForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert isinstance(loaded, LoopedForCausalLM)
    return loaded


def max_delta(actual, expected) -> float:
    """The largest absolute difference of two tensors, in float32."""
    return (actual.detach().float() - expected.float()).abs().max().item()


def remote_code_results(folder: Path, reference: Path, body: str, tmp_path: Path) -> dict:
    """Run ``body`` in a Python without looped_hf, where ``m`` is ``folder`` loaded as remote code
    (float32, eval; checked to come from transformers_modules), ``ref`` the fixture's
    ``reference.npz`` at ``reference`` and ``out`` a dict the body fills (under no_grad); return ``out``."""
    import json
    import textwrap

    from conftest import run_without_looped_hf

    script = (
        "import json, numpy as np, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True, dtype=torch.float32).eval()\n"
        "assert type(m).__module__.startswith('transformers_modules'), type(m).__module__\n"
        f"ref = np.load({str(reference)!r})\n"
        "out = {}\n"
        "with torch.no_grad():\n" + textwrap.indent(textwrap.dedent(body).strip("\n"), "    ") + "\n"
        "print(json.dumps(out))\n"
    )
    return json.loads(run_without_looped_hf(script, tmp_path).strip().splitlines()[-1])
