"""Tokenizers by name: the embedded BPE, byte-level, a local file or directory, or a Hub name.

Every tokenizer ``load_tokenizer`` returns has an EOS and a pad token distinct from it, pads on the
left (decoder-only generation), and a stable ``tokenizer_fingerprint`` that keys the data cache.
"""

import hashlib
import json
import os
from collections.abc import Sequence
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from .corpus import EMBEDDED, embedded_tokenizer_path

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
BYTES = "bytes"
#: The names of the tokenizers shipped with looped_hf: never a Hub id or a path, wherever a
#: tokenizer is asked for (`load_tokenizer` is the one resolver of a tokenizer name).
BUILTIN_TOKENIZERS = (EMBEDDED, BYTES)


def is_builtin_tokenizer(name: str | None) -> bool:
    """Whether ``name`` (without ``+TOKEN`` parts) names a built-in tokenizer (None: the embedded one)."""
    return name is None or name in BUILTIN_TOKENIZERS


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what ByteLevel pre-tokenizers use)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _byte_tokenizer_object():
    """Byte-level tokenizer: id = byte value (0-255), then EOS (256) and PAD (257). No training."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    vocab[EOS_TOKEN], vocab[PAD_TOKEN] = 256, 257
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS_TOKEN, PAD_TOKEN])
    return tok


def _wrap(tokenizer_object: Any, name: str) -> PreTrainedTokenizerFast:
    # BOS = EOS as in GPT-2: generation from nothing starts "after a document end". Packing never
    # adds BOS; documents are separated by EOS only.
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer_object, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN, pad_token=PAD_TOKEN
    )
    tok.name_or_path = name
    return tok


def _ensure_special_tokens(tok: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """Give a loaded tokenizer an EOS and a pad token distinct from EOS, adding tokens only if needed.

    A pad equal to EOS would make ``DataCollatorForLanguageModeling`` mask every EOS label, so the
    model would never learn to end a document. Reusing an existing unknown token as pad keeps the
    vocabulary size; only when there is none is a new ``<|pad|>`` added (then ``len(tok)`` grows
    by one: size the model's embedding with ``len(tok)``, not ``tok.vocab_size``).
    """
    if tok.eos_token is None:
        if tok.sep_token is not None:
            tok.eos_token = tok.sep_token
        else:
            tok.add_special_tokens({"eos_token": EOS_TOKEN})
    if tok.pad_token is None:
        if tok.unk_token is not None and tok.unk_token != tok.eos_token:
            tok.pad_token = tok.unk_token
        else:
            tok.add_special_tokens({"pad_token": PAD_TOKEN})
    return tok


def split_tokenizer_spec(spec: str | None) -> tuple[str | None, list[str]]:
    """``"NAME+TOKEN+..."`` -> ``(NAME, [TOKEN, ...])``: a tokenizer plus special tokens added to it.

    The study's tokenizer is ``NousResearch/Llama-2-7b-hf+<|assistant_end|>`` (nanochat/tokenizer.py:
    Llama-2's 32,000 tokens plus one added special token, vocabulary 32,001). One string, so every
    place that loads a recipe's tokenizer by name gets the same vocabulary. An existing local path
    is taken whole; Hub ids cannot contain ``+``.
    """
    if spec is None or "+" not in spec or os.path.exists(spec):
        return spec, []
    name, *extra = spec.split("+")
    if not name or not all(extra):
        raise ValueError(
            f"DataArguments.tokenizer={spec!r}: expected NAME+TOKEN[+TOKEN...], with no empty part"
        )
    return name, extra


def add_study_special_tokens(raw_tokenizer: Any, tokens: Sequence[str]) -> None:
    """Add ``tokens`` to a ``tokenizers.Tokenizer`` as nanochat/tokenizer.py does: special
    ``AddedToken``s after the base vocabulary, ids in order."""
    from tokenizers import AddedToken

    if tokens:
        raw_tokenizer.add_special_tokens([AddedToken(t, special=True) for t in tokens])


def load_tokenizer(name: str | None = None) -> PreTrainedTokenizerBase:
    """Load a tokenizer by name: the embedded BPE, the byte-level one, a local path or a Hub name.

    Args:
        name: ``None`` or ``"embedded"``: byte-level BPE shipped in ``looped_hf/assets`` (4096 tokens,
            trained on the embedded corpus, ~3.3 characters per token). ``"bytes"``: one token per
            UTF-8 byte plus EOS and PAD (258 tokens; needs no file, for unit tests). A path to a
            ``tokenizer.json`` file or to a directory saved with ``save_pretrained``; otherwise a
            Hub name through ``AutoTokenizer.from_pretrained``. Any of these followed by
            ``+TOKEN[+TOKEN...]`` adds those special tokens (see ``split_tokenizer_spec``; the
            study's: ``NousResearch/Llama-2-7b-hf+<|assistant_end|>``).

    Returns:
        A transformers tokenizer with ``eos_token`` and a ``pad_token`` distinct from it (added if
        the loaded one lacks them, see ``_ensure_special_tokens``). Use ``len(tokenizer)`` as the
        model's vocabulary size.
    """
    spec = name
    name, extra = split_tokenizer_spec(spec)
    raw = None
    if name is None or name == EMBEDDED:
        from tokenizers import Tokenizer

        raw, label = Tokenizer.from_file(str(embedded_tokenizer_path())), "looped_hf/embedded-bpe-4096"
    elif name == BYTES:
        raw, label = _byte_tokenizer_object(), "looped_hf/bytes"
    elif os.path.isfile(name) and name.endswith(".json"):
        from tokenizers import Tokenizer

        raw, label = Tokenizer.from_file(name), name
    if raw is not None:
        add_study_special_tokens(raw, extra)  # before wrapping: exactly the study's step
        tok = _wrap(raw, label if not extra else spec)
    else:
        tok = AutoTokenizer.from_pretrained(name)  # local directory or Hub name
        if extra:
            from tokenizers import AddedToken

            tok.add_tokens(
                [AddedToken(t, special=True, normalized=False) for t in extra], special_tokens=True
            )
    tok = _ensure_special_tokens(tok)
    # Decoder-only generation pads on the left, so every prompt of a batch ends at the last
    # position; the tokenizer saved with each checkpoint carries this. Training packs full blocks
    # (no padding), so it changes nothing there.
    tok.padding_side = "left"
    tok.init_kwargs["padding_side"] = "left"  # what save_pretrained writes to tokenizer_config.json
    return tok


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """Stable hash of what determines token ids: the serialized tokenizer (or vocabulary) and EOS."""
    digest = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        digest.update(backend.to_str().encode())
    else:  # slow (Python) tokenizers: the vocabulary is the best stable proxy we have
        digest.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    digest.update(f"eos={tokenizer.eos_token_id}".encode())
    return digest.hexdigest()
