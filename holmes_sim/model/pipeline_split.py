"""Megatron-Core's uneven pipeline split: layers per virtual stage from the four split flags.

Source: Megatron-Core `get_num_layers_to_build` (megatron/core/transformer/transformer_block.py)
and `TransformerConfig.__post_init__` (megatron/core/transformer/transformer_config.py):
- `decoder_first_pipeline_num_layers` / `decoder_last_pipeline_num_layers` fix the layers of the
  first / last pipeline rank; the other ranks share the rest evenly (it must divide);
- else `account_for_embedding_in_pipeline_split` / `account_for_loss_in_pipeline_split` add one
  layer slot each to the count, which must divide by the pipeline degree; the embedding takes a
  slot of the first virtual stage, the loss one of the last;
- a rank's layers split evenly over its v model chunks (they must divide).
The two pairs of flags exclude each other (Megatron raises a ValueError).
"""

from __future__ import annotations

from dataclasses import dataclass

from holmes_sim.errors import FieldError
from holmes_sim.spec.job import TrainingSpec


@dataclass(frozen=True, slots=True)
class PipelineSplit:
    """The four Megatron-LM split flags (`TrainingSpec`); all unset: the equal split."""

    first_layers: int | None = None
    last_layers: int | None = None
    account_for_embedding: bool = False
    account_for_loss: bool = False

    @staticmethod
    def of(training: TrainingSpec) -> PipelineSplit:
        return PipelineSplit(training.decoder_first_pipeline_num_layers,
                             training.decoder_last_pipeline_num_layers,
                             training.account_for_embedding_in_pipeline_split,
                             training.account_for_loss_in_pipeline_split)

    @property
    def is_set(self) -> bool:
        return self != PipelineSplit()


_FIRST = "training.decoder_first_pipeline_num_layers"


def megatron_layers_per_stage(num_layers: int, pp: int, v: int,
                              split: PipelineSplit) -> tuple[int, ...]:
    """Layers of every virtual stage (j = chunk * pp + rank, model order) as Megatron-Core
    builds them under `split`.

    Raises:
        FieldError: naming the flag whose counts do not add up or divide.
    """
    per_rank = _per_rank(num_layers, pp, split)
    for s, n in enumerate(per_rank):
        if n % v:
            raise FieldError(_FIRST if s == 0 and split.first_layers else
                             "parallel.virtual_stages",
                             f"pipeline rank {s} gets {n} layer slots, not a multiple of "
                             f"virtual_stages={v}; change the split or the virtual stages")
    layers = [per_rank[j % pp] // v for j in range(pp * v)]
    if split.account_for_embedding:
        layers[0] -= 1
    if split.account_for_loss:
        layers[-1] -= 1
    if min(layers) < 1:
        raise FieldError("training.account_for_embedding_in_pipeline_split",
                         f"the split {layers} leaves a virtual stage without layers; "
                         "use fewer pipeline or virtual stages")
    return tuple(layers)


def _per_rank(num_layers: int, pp: int, split: PipelineSplit) -> list[int]:
    """Layer slots of each pipeline rank (the embedding and loss slots included)."""
    first, last = split.first_layers, split.last_layers
    if first is not None or last is not None:
        if split.account_for_embedding or split.account_for_loss:
            raise FieldError(_FIRST, "decoder_first/last_pipeline_num_layers cannot be set "
                             "together with account_for_embedding/loss_in_pipeline_split "
                             "(Megatron-Core raises the same); keep one pair")
        if pp == 1:
            raise FieldError(_FIRST, "an uneven pipeline split needs parallel.pipeline > 1")
        given = [n for n in (first, last) if n is not None]
        rest, ranks = num_layers - sum(given), pp - len(given)
        if rest < 0 or (ranks == 0 and rest != 0) or (ranks > 0 and (rest <= 0 or rest % ranks)):
            raise FieldError(_FIRST, f"first={first}, last={last} leave {rest} of "
                             f"model.num_layers={num_layers} layers for {ranks} middle pipeline "
                             "ranks; they must divide evenly (at least one each)")
        middle = rest // ranks if ranks else 0
        return [first if s == 0 and first is not None else
                last if s == pp - 1 and last is not None else middle for s in range(pp)]
    slots = num_layers + split.account_for_embedding + split.account_for_loss
    if slots % pp:
        raise FieldError("training.account_for_embedding_in_pipeline_split",
                         f"model.num_layers={num_layers} plus the embedding and loss slots "
                         f"({slots}) must divide by parallel.pipeline={pp}")
    return [slots // pp] * pp
