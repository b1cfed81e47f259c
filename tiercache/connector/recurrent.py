"""Start-up rules for engines with recurrent (Mamba/GDN/KDA) KV-cache groups
(:func:`check_recurrent_config`): which vLLM settings let the connector store and restore
recurrent state at chunk boundaries, which make it impossible (a :class:`ConfigError`), and which
only make hits coarser (warnings). The layout itself (:func:`~tiercache.connector.layout.derive_layout`)
and the detection of Mamba2's in-step checkpoints on vLLM's CPU build
(:func:`~tiercache.connector.layout.cpu_in_step_checkpoints`) stay in
:mod:`tiercache.connector.layout`.
"""

from __future__ import annotations

from tiercache.errors import ConfigError


def check_recurrent_config(
    *,
    mamba_cache_mode: str | None,
    enable_prefix_caching: bool,
    max_num_batched_tokens: int,
    block_size: int,
    chunk_size: int,
    separate_object_groups: bool,
    in_step_checkpoints_on_cpu: bool = False,
) -> list[str]:
    """Start-up rules for engines with recurrent (Mamba/GDN/KDA) KV-cache groups.

    Raises :class:`ConfigError` for a configuration under which the connector could never store or
    restore recurrent state; returns warnings for one that works but hits less than it could.

    * ``mamba_cache_mode`` must be ``"align"`` and prefix caching on: only then does vLLM keep the
      state at block boundaries (``"none"`` keeps no reusable state at all).
    * In align mode vLLM clips each prefill step to whole blocks, so a step covers
      ``step = max_num_batched_tokens // block_size * block_size`` tokens and the state exists only at
      step ends; ``step`` must be at least one block (else prefill cannot progress).
    * With separate object groups a hit of ``b`` chunks needs the state at chunk boundary ``b`` only:
      step ends must meet chunk boundaries somewhere (``step`` a multiple of ``chunk_size`` or a
      divisor of it), else no recurrent object is ever stored (error).
    * With one object per chunk (``--no-separate-object-groups``) every chunk's object carries the
      state at its end, so a step must end on every chunk boundary: ``chunk_size`` must be a
      multiple of ``step``.
    * ``in_step_checkpoints_on_cpu``
      (:func:`~tiercache.connector.layout.cpu_in_step_checkpoints`: Mamba2 on vLLM's CPU build):
      ``max_num_batched_tokens`` must be exactly one block, else vLLM itself fails on the first
      prefill step that crosses a block boundary (its CPU scan cannot export the mid-step state).
    """
    _check_recurrent_mode(mamba_cache_mode, enable_prefix_caching)
    step = _recurrent_step(max_num_batched_tokens, block_size, in_step_checkpoints_on_cpu)
    return _check_step_alignment(step, max_num_batched_tokens, block_size, chunk_size, separate_object_groups)


def _check_recurrent_mode(mamba_cache_mode: str | None, enable_prefix_caching: bool) -> None:
    """Raise :class:`ConfigError` unless vLLM keeps recurrent state at block boundaries (align mode,
    prefix caching on); :func:`check_recurrent_config`'s first two rules."""
    if mamba_cache_mode != "align":
        raise ConfigError(
            f"this model has recurrent (Mamba/GDN/KDA) layers and mamba_cache_mode={mamba_cache_mode!r}: "
            'the tiercache connector needs mamba_cache_mode="align", the only mode in which vLLM keeps '
            "reusable recurrent state at block boundaries. vLLM sets it when prefix caching is on "
            "(--enable-prefix-caching); on vLLM 0.32 also --mamba-cache-mode align (from 0.33 that flag is "
            "deprecated and has no effect)"
        )
    if not enable_prefix_caching:
        raise ConfigError(
            "this model has recurrent (Mamba/GDN/KDA) layers: the tiercache connector needs prefix caching "
            "on (--enable-prefix-caching) so vLLM keeps the recurrent state at block boundaries"
        )


def _recurrent_step(max_num_batched_tokens: int, block_size: int, in_step_checkpoints_on_cpu: bool) -> int:
    """Tokens per align-mode prefill step (whole blocks), or :class:`ConfigError` when a step cannot
    progress or (vLLM's CPU build) would cross a block boundary; see :func:`check_recurrent_config`."""
    step = max_num_batched_tokens // block_size * block_size
    if step < block_size:
        raise ConfigError(
            f"max_num_batched_tokens {max_num_batched_tokens} is smaller than the block size {block_size}: in "
            f"mamba_cache_mode align prefill steps are whole blocks, so nothing could be computed; set "
            f"--max-num-batched-tokens to at least {block_size}"
        )
    if in_step_checkpoints_on_cpu and max_num_batched_tokens > block_size:
        raise ConfigError(
            f"max_num_batched_tokens {max_num_batched_tokens} is larger than the block size {block_size}: this "
            "model's recurrent layers (Mamba2) save the state at a block boundary inside a prefill step, which "
            "vLLM's CPU chunk scan cannot compute (the engine would fail with an IndexError in mamba_mixer2 on "
            f"the first prefill step that crosses a block boundary); on the CPU build set --max-num-batched-tokens "
            f"{block_size}"
        )
    return step


def _check_step_alignment(
    step: int, max_num_batched_tokens: int, block_size: int, chunk_size: int, separate_object_groups: bool
) -> list[str]:
    """Raise :class:`ConfigError` unless prefill steps of ``step`` tokens end on the chunk boundaries
    the object grouping needs; return warnings for coarser hits (see :func:`check_recurrent_config`)."""
    warnings: list[str] = []
    if separate_object_groups:
        if step % chunk_size and chunk_size % step:
            raise ConfigError(
                f"prefill steps of {step} tokens (max_num_batched_tokens {max_num_batched_tokens} in blocks of "
                f"{block_size}) never end on a chunk boundary of the tiercache server's --chunk-size "
                f"{chunk_size}, so no recurrent state would ever be stored; use a --max-num-batched-tokens "
                f"that is a multiple or a divisor of {chunk_size}"
            )
        if step > chunk_size:
            warnings.append(
                f"recurrent state exists only every {step} tokens (prefill step), so hits are multiples of "
                f"{step} tokens, not of the chunk size {chunk_size}"
            )
    elif chunk_size % step:
        raise ConfigError(
            f"with --no-separate-object-groups every chunk's object holds the recurrent state at its end, so "
            f"every prefill step must end on a chunk boundary, but steps are {step} tokens "
            f"(max_num_batched_tokens {max_num_batched_tokens}) and --chunk-size is {chunk_size}; set "
            f"--max-num-batched-tokens to a divisor of {chunk_size} (a multiple of {block_size}) or run the "
            "server with separate object groups"
        )
    return warnings
