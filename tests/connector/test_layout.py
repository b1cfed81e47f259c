"""The engine's layout as the connector reads it at start-up (:mod:`tiercache.connector.layout`):
block sizes against the chunk size, which KV-cache group kinds it accepts, which chunks of each
group a hit needs, the start-up rules for recurrent (Mamba/GDN) groups
(:mod:`tiercache.connector.recurrent`), and the weights identity
(:mod:`tiercache.keys.weights`) that names the model in the layout's fingerprint.

Plain Python: fake spec objects stand in for vLLM's (only their class names and fields matter)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tiercache.connector import layout
from tiercache.connector.layout import (
    GroupLayout,
    check_block_sizes,
    check_group_specs,
)
from tiercache.connector.recurrent import check_recurrent_config
from tiercache.errors import ConfigError
from tiercache.keys.weights import content_fingerprint, weights_identity


def test_chunk_size_error_states_both_sizes_and_the_fix() -> None:
    check_block_sizes(128, 32, [32])
    with pytest.raises(ConfigError) as err:
        check_block_sizes(48, 32, [32])
    msg = str(err.value)
    assert "--chunk-size 48" in msg and "block size 32" in msg and "--chunk-size 32 or a multiple" in msg


# -- the weights identity ------------------------------------------------------------------------------


def _checkpoint(d: Path, payload: bytes) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text('{"model_type": "llama"}')
    (d / "model.safetensors").write_bytes(payload)
    return d


def test_weights_identity_follows_the_weights_not_the_path(tmp_path: Path) -> None:
    model = _checkpoint(tmp_path / "m", b"A" * 3_000_000)
    first = weights_identity(str(model))
    assert first.startswith("files:") and weights_identity(str(model)) == first
    (model / "model.safetensors").write_bytes(b"B" * 3_000_000)  # other weights, same path and size
    assert weights_identity(str(model)) != first
    assert weights_identity(str(model), override="my-build-7") == "id:my-build-7"


def test_weights_identity_without_files_uses_the_revision(tmp_path: Path) -> None:
    assert content_fingerprint(tmp_path) is None
    assert weights_identity("org/not-a-cached-model-xyz", revision="abc123") == "rev:abc123"


# -- KV-cache group kinds (fake spec objects: only the class names and fields matter) -----------------


def _fake_spec(cls_name: str, block_size: int = 32, **fields: object) -> object:
    return type(cls_name, (), {"block_size": block_size, **fields})()


def test_full_sliding_and_recurrent_groups_are_accepted() -> None:
    check_group_specs([_fake_spec("SlidingWindowSpec", sliding_window=64), _fake_spec("FullAttentionSpec")])
    check_group_specs([_fake_spec("MambaSpec", num_speculative_blocks=0), _fake_spec("FullAttentionSpec")])


@pytest.mark.parametrize(
    "spec, words",
    [
        (_fake_spec("MambaSpec", num_speculative_blocks=2), "speculative"),
        (_fake_spec("ChunkedLocalAttentionSpec", attention_chunk_size=64), "not supported"),
        (_fake_spec("SlidingWindowSpec", sliding_window=64, extra_retained_tokens=3), "extra retained"),
    ],
)
def test_unsupported_groups_fail_with_a_clear_error(spec: object, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        check_group_specs([_fake_spec("FullAttentionSpec"), spec])


def test_sliding_group_needs_only_its_trailing_window_chunks() -> None:
    def group(window: int) -> GroupLayout:
        return GroupLayout(0, 0, 0, ("l0",), 32, 2, 8192, None, window_tokens=window)  # type: ignore[arg-type]

    assert list(group(0).needed_chunks(3, 64)) == [0, 1, 2]
    assert list(group(64).needed_chunks(3, 64)) == [2]
    assert list(group(65).needed_chunks(3, 64)) == [1, 2]  # ceil(65 / 64) = 2 chunks
    assert list(group(4096).needed_chunks(3, 64)) == [0, 1, 2]


def test_recurrent_group_needs_only_the_state_at_the_boundary() -> None:
    state = GroupLayout(1, 1, 0, ("l0",), 384, 1, 134144, None, recurrent=True)  # type: ignore[arg-type]
    assert list(state.needed_chunks(3, 384)) == [2]  # the state after chunk 2 = the state at 3 chunks
    assert list(state.needed_chunks(0, 384)) == []
    assert state.object_bytes == 134144  # one state page per layer, whatever the chunk size


# -- start-up rules for recurrent (Mamba/GDN) groups ------------------------------------------------


def _recurrent(**kw: Any) -> list[str]:
    args: dict[str, Any] = {
        "mamba_cache_mode": "align",
        "enable_prefix_caching": True,
        "max_num_batched_tokens": 768,
        "block_size": 384,
        "chunk_size": 384,
        "separate_object_groups": True,
    }
    args.update(kw)
    return check_recurrent_config(**args)


def test_recurrent_config_that_works() -> None:
    assert _recurrent() == [
        "recurrent state exists only every 768 tokens (prefill step), so hits are multiples of 768 tokens, not of the chunk size 384"
    ]
    assert _recurrent(max_num_batched_tokens=384) == []
    assert _recurrent(max_num_batched_tokens=800, chunk_size=768) == []  # steps of 768 (whole blocks)
    assert _recurrent(max_num_batched_tokens=384, separate_object_groups=False, chunk_size=768) == []


@pytest.mark.parametrize(
    "kw, words",
    [
        ({"mamba_cache_mode": "none"}, 'mamba_cache_mode="align"'),
        ({"mamba_cache_mode": None}, "--mamba-cache-mode align"),
        ({"enable_prefix_caching": False}, "--enable-prefix-caching"),
        ({"max_num_batched_tokens": 256}, "at least 384"),
        ({"max_num_batched_tokens": 1152, "chunk_size": 768}, "multiple or a divisor of 768"),
        ({"separate_object_groups": False}, "divisor of 384"),
    ],
)
def test_recurrent_config_errors_name_the_fix(kw: dict[str, object], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        _recurrent(**kw)


def test_mamba2_on_cpu_needs_steps_of_one_block() -> None:
    """vLLM 0.32's CPU Mamba2 scan cannot export a mid-step checkpoint: any step longer than one
    block (even 500 tokens with N = 384: a prompt's last step may cross a boundary) kills the engine."""
    assert _recurrent(max_num_batched_tokens=384, in_step_checkpoints_on_cpu=True) == []
    for tokens in (500, 768):
        with pytest.raises(ConfigError, match="set --max-num-batched-tokens 384"):
            _recurrent(max_num_batched_tokens=tokens, in_step_checkpoints_on_cpu=True)


def test_in_step_checkpoints_are_detected_from_the_spec_and_platform(monkeypatch: pytest.MonkeyPatch) -> None:
    mamba2 = _fake_spec("MambaSpec", num_speculative_blocks=0, num_prefill_checkpoint_blocks=1)
    gdn = _fake_spec("MambaSpec", num_speculative_blocks=0, num_prefill_checkpoint_blocks=0)
    full = _fake_spec("FullAttentionSpec", num_prefill_checkpoint_blocks=1)  # not a recurrent group
    monkeypatch.setattr(layout, "_platform_extras", lambda: (("device", "cpu"),))
    assert layout.cpu_in_step_checkpoints([mamba2, _fake_spec("FullAttentionSpec")])
    assert not layout.cpu_in_step_checkpoints([gdn, full])
    monkeypatch.setattr(layout, "_platform_extras", lambda: (("device", "cuda"),))
    assert not layout.cpu_in_step_checkpoints([mamba2])


def test_recurrent_mode_error_names_prefix_caching_too() -> None:
    """vLLM 0.33 derives mamba_cache_mode from prefix caching (--mamba-cache-mode is a no-op there)."""
    with pytest.raises(ConfigError, match="--enable-prefix-caching"):
        _recurrent(mamba_cache_mode="none")
