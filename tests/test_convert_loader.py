"""The one checkpoint loader (``looped_hf.convert.loader``): a folder read as transformers reads it.

What retrofit and every converter rely on: a sharded folder gives the same tensors as the single
file, each key from the shard the index names; tensors are read on demand; dtypes and shapes come
from the headers; the weight files' sha256 is reported; the config helpers check what they read.
The refusals (one line, nothing written) are in tests/test_refusals.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import fixture_path
from safetensors.torch import load_file, save_file

from looped_hf.configuration_looped import MAX_NUM_RECURRENCES
from looped_hf.convert import ConversionError
from looped_hf.convert.loader import (
    Checkpoint,
    check_known_keys,
    check_recurrences,
    config_bool,
    config_rope_parameters,
    rope_parameters,
    token_ids,
)
from looped_hf.fileio import sha256_file

ZOO = fixture_path("zoo")


def copy_checkpoint(name: str, dest: Path) -> Path:
    """A writable copy of a zoo fixture folder (config, weights, generation config)."""
    shutil.copytree(ZOO / name, dest)
    for file in dest.iterdir():
        file.chmod(0o644)
    return dest


def shard(folder: Path, parts: int = 2) -> dict[str, str]:
    """Split ``folder``'s model.safetensors into ``parts`` shards and an index, as transformers'
    save_pretrained(max_shard_size=...) lays them out; returns the weight_map."""
    weights = load_file(folder / "model.safetensors")
    names = sorted(weights)
    weight_map = {}
    for i in range(parts):
        file = f"model-{i + 1:05d}-of-{parts:05d}.safetensors"
        chunk = names[i::parts]
        save_file({k: weights[k] for k in chunk}, folder / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(chunk, file))
    (folder / "model.safetensors").unlink()
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in weights.values())},
             "weight_map": weight_map}  # fmt: skip
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return weight_map


@pytest.mark.parametrize("name", ["ouro-tiny", "huginn-tiny"])
def test_a_sharded_folder_reads_every_tensor_from_the_shard_the_index_names(
    name: str, tmp_path: Path
) -> None:
    single = Checkpoint(ZOO / name)
    folder = copy_checkpoint(name, tmp_path / name)
    weight_map = shard(folder, parts=3)
    sharded = Checkpoint(folder)
    assert sorted(sharded.keys()) == sorted(single.keys()) == sorted(weight_map)
    assert len(sharded.files) == 3 and set(sharded.sha256()) == set(weight_map.values())
    for key in single.keys():
        assert torch.equal(sharded.get_tensor(key), single.get_tensor(key)), key
        assert sharded.dtype(key) == single.dtype(key) and sharded.shape(key) == single.shape(key)


def test_tensors_are_read_on_demand_and_the_headers_give_dtypes_and_shapes(tmp_path: Path) -> None:
    folder = copy_checkpoint("ouro-tiny", tmp_path / "ouro")
    native = load_file(folder / "model.safetensors")
    save_file({k: v.to(torch.bfloat16) for k, v in native.items()}, folder / "model.safetensors")
    ckpt = Checkpoint(folder, model_types=("ouro",))
    assert set(ckpt.dtypes.values()) == {torch.bfloat16} and ckpt.floating_dtype() == torch.bfloat16
    assert ckpt.shape("lm_head.weight") == (256, 64) and "lm_head.weight" in ckpt
    assert ckpt.num_elements() == sum(t.numel() for t in native.values())
    head = ckpt.get_tensor("lm_head.weight")
    assert head.dtype == torch.bfloat16 and torch.equal(head, native["lm_head.weight"].to(torch.bfloat16))
    assert ckpt.sha256() == {"model.safetensors": sha256_file(folder / "model.safetensors")}
    assert ckpt.config["model_type"] == "ouro" and ckpt.generation_token_ids(256) == {}
    with pytest.raises(ConversionError, match=r"model_type='ouro': this converter reads 'llama'"):
        Checkpoint(folder, model_types=("llama",))


def test_a_tensor_read_is_its_own_memory_and_leaves_no_file_mapped(tmp_path: Path) -> None:
    """Retrofit fills its model in place from parent tensors: writing into one must not change the
    next read of the same key, and reading a whole parent must not keep its files mapped (resident)."""
    folder = copy_checkpoint("ouro-tiny", tmp_path / "ouro")
    ckpt = Checkpoint(folder)
    first = ckpt.get_tensor("lm_head.weight")
    expected = first.clone()
    first.add_(1.0)
    assert torch.equal(ckpt.get_tensor("lm_head.weight"), expected)
    for _ in ckpt.items():
        pass
    maps = Path("/proc/self/maps")
    if maps.exists():  # Linux: no mapping of the weight file survives the reads
        assert str((folder / "model.safetensors").resolve()) not in maps.read_text()


def test_mixed_dtypes_are_reported_and_an_excluded_buffer_is_not_counted(tmp_path: Path) -> None:
    folder = copy_checkpoint("huginn-tiny", tmp_path / "huginn")
    native = load_file(folder / "model.safetensors")
    native["freqs_cis"] = native["freqs_cis"].to(torch.bfloat16)
    save_file(native, folder / "model.safetensors")
    ckpt = Checkpoint(folder)
    assert ckpt.floating_dtype(exclude=("freqs_cis",)) == torch.float32
    with pytest.raises(ConversionError, match=r"dtypes \['torch.bfloat16', 'torch.float32'\]: expected one"):
        ckpt.floating_dtype()


def test_a_hub_cache_snapshot_whose_files_link_into_blobs_is_read(tmp_path: Path) -> None:
    """transformers' cache keeps each file once in <repo>/blobs and links it from snapshots/<rev>:
    the one kind of link out of the folder the loader follows."""
    repo = tmp_path / "models--org--ouro"
    snapshot, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for file in (ZOO / "ouro-tiny").iterdir():
        shutil.copyfile(file, blobs / file.name)
        (snapshot / file.name).symlink_to(Path("../../blobs") / file.name)
    assert len(Checkpoint(snapshot).keys()) == 27


def test_rope_scaling_becomes_rope_parameters_with_each_types_keys() -> None:
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}  # fmt: skip
    assert rope_parameters(llama3, 5e5) == {**llama3, "rope_theta": 5e5}
    assert rope_parameters({"type": "linear", "factor": 2.0}, 1e4) == {
        "factor": 2.0, "rope_type": "linear", "rope_theta": 1e4}  # fmt: skip
    assert (
        rope_parameters(None, 1e4) == rope_parameters({}, 1e4) == {"rope_type": "default", "rope_theta": 1e4}
    )
    with pytest.raises(
        ConversionError, match=r"rope_scaling has no 'high_freq_factor': rope_type 'llama3' needs"
    ):
        rope_parameters({k: v for k, v in llama3.items() if k != "high_freq_factor"}, 5e5)
    with pytest.raises(ConversionError, match=r"rope_scaling.factor=0.5: expected a number >= 1"):
        rope_parameters({"rope_type": "dynamic", "factor": 0.5}, 1e4)
    with pytest.raises(ConversionError, match=r"rope_scaling.short_factor=\[\]: expected a list of numbers"):
        rope_parameters({"rope_type": "longrope", "short_factor": [], "long_factor": [1.0],
                         "original_max_position_embeddings": 4096}, 1e4)  # fmt: skip


def test_token_ids_may_be_lists_inside_the_vocabulary() -> None:
    assert token_ids({"bos_token_id": 1, "eos_token_id": [2, 3], "pad_token_id": None}, 10, "g.json") == {
        "bos_token_id": 1, "eos_token_id": [2, 3]}  # fmt: skip
    for bad in (10, -1, True, "2", [], [1, 99]):
        with pytest.raises(
            ConversionError, match=r"g.json eos_token_id=.*: expected a token id in \[0, 10\)"
        ):
            token_ids({"eos_token_id": bad}, 10, "g.json")


def test_flags_and_unknown_keys_are_checked_by_one_rule() -> None:
    assert config_bool({"tie": True}, "tie", False) is True and config_bool({}, "tie", False) is False
    with pytest.raises(ConversionError, match=r"config.json tie=1: expected true or false"):
        config_bool({"tie": 1}, "tie", False)
    check_known_keys({"architectures": [], "transformers_version": "5", "width": 3}, {"width"}, "demo")
    with pytest.raises(
        ConversionError, match=r"config.json zeta=1: unknown demo config key \(keys \['zeta'\]"
    ):
        check_known_keys({"width": 3, "zeta": 1}, {"width"}, "demo")
    # The ceiling is LoopedConfig's own: r at it converts, one more is refused naming the key.
    assert check_recurrences(MAX_NUM_RECURRENCES, "num_loops") == MAX_NUM_RECURRENCES
    with pytest.raises(ConversionError, match=rf"config.json num_loops={MAX_NUM_RECURRENCES + 1}: above the ceiling"):
        check_recurrences(MAX_NUM_RECURRENCES + 1, "num_loops")


def test_a_transformers_5_config_gives_its_rope_parameters_checked_alike() -> None:
    v5 = {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}
    assert config_rope_parameters(v5) == {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}
    v4 = {"rope_theta": 1e6, "rope_scaling": {"type": "linear", "factor": 2.0}}
    assert config_rope_parameters(v4) == config_rope_parameters(v5)
    assert config_rope_parameters({}) == {"rope_type": "default", "rope_theta": 10000.0}
    with pytest.raises(
        ConversionError, match=r"config.json rope_parameters has no 'factor': rope_type 'yarn'"
    ):
        config_rope_parameters({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}})
    with pytest.raises(
        ConversionError, match=r"config.json rope_parameters.rope_theta=-1: expected a finite"
    ):
        config_rope_parameters({"rope_parameters": {"rope_type": "default", "rope_theta": -1}})
    with pytest.raises(ConversionError, match=r"config.json has no 'rope_theta'"):
        config_rope_parameters({}, default_theta=...)


def test_the_vocabulary_defaults_to_the_configs_for_the_token_and_tokenizer_checks(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models

    folder = copy_checkpoint("ouro-tiny", tmp_path / "ouro")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 255]}))
    Tokenizer(models.WordLevel({f"w{i}": i for i in range(257)}, unk_token="w0")).save(
        str(folder / "tokenizer.json")
    )
    ckpt = Checkpoint(folder)
    assert ckpt.generation_token_ids() == {"eos_token_id": [1, 255]}
    with pytest.raises(
        ConversionError, match=r"the tokenizer has 257 tokens, more than the model's vocab_size=256"
    ):
        ckpt.copy_tokenizer(tmp_path / "dst")
    assert ckpt.check_tokenizer(300) == 257 and not (tmp_path / "dst").exists()
