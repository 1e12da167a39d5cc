"""Model cards: one for a checkpoint (what a Hub user loads), one for a sweep (phi and its evidence).

    looped-hf card runs/iso_depth_tiny --fit runs/iso_depth_tiny/fit.json      # -> runs/iso_depth_tiny/card/
    looped-hf card runs/iso_depth_tiny --bootstrap 200 --out model_cards/iso_depth_tiny

Both cards are Jinja templates in ``model_cards/templates/`` rendered with
``huggingface_hub.ModelCard.from_template``; the YAML front matter is a ``ModelCardData`` so it
parses back with ``ModelCard.load`` and carries what the Hub indexes (``library_name``,
``pipeline_tag``, tags, ``model-index``) plus a ``looped:`` block with the loop's shape and
counts. Nothing here touches the network (``card.validate()`` would: it is never called).

The held-out loss in a card is the run record's ``loss``: the token-weighted mean NLL over the
held-out blocks (``looped_hf.train.heldout_loss``); perplexity is ``exp`` of it, the same
quantity the shipped ``evaluate`` metric ``looped_hf/metrics/token_perplexity`` computes from NLL
sums and token counts.

The package, by what a reader looks for: ``checkpoint`` (the card of one checkpoint),
``sweep`` (the card of a sweep), ``common`` (formatting, templates, held-out numbers, phi's
caveat: what both share) and ``cli`` (``looped-hf card``). Everything is importable from
``looped_hf.cards`` as before the split.
"""

from __future__ import annotations

from .checkpoint import architecture_diagram as architecture_diagram
from .checkpoint import checkpoint_card_data as checkpoint_card_data
from .checkpoint import evaluation_model_index as evaluation_model_index
from .checkpoint import render_checkpoint_card as render_checkpoint_card
from .checkpoint import tokenizer_description as tokenizer_description
from .cli import main as main
from .common import CARD_NAME as CARD_NAME
from .common import CHECKPOINT_TEMPLATE as CHECKPOINT_TEMPLATE
from .common import FIT_NAME as FIT_NAME
from .common import LOOPED_HF_URL as LOOPED_HF_URL
from .common import PLOTS_DIR as PLOTS_DIR
from .common import SWEEP_TEMPLATE as SWEEP_TEMPLATE
from .common import TEMPLATES_DIR as TEMPLATES_DIR
from .common import PathLike as PathLike
from .common import heldout_metrics as heldout_metrics
from .common import perplexity_from_loss as perplexity_from_loss
from .common import phi_caveat as phi_caveat
from .common import sha256_file as sha256_file
from .common import si as si
from .sweep import best_run as best_run
from .sweep import card_image_links as card_image_links
from .sweep import default_commands as default_commands
from .sweep import evaluation_section as evaluation_section
from .sweep import fit_summary as fit_summary
from .sweep import identifiability_summary as identifiability_summary
from .sweep import render_sweep_card as render_sweep_card
from .sweep import write_sweep_card as write_sweep_card

__all__ = [
    "architecture_diagram",
    "best_run",
    "card_image_links",
    "checkpoint_card_data",
    "fit_summary",
    "identifiability_summary",
    "heldout_metrics",
    "main",
    "render_checkpoint_card",
    "render_sweep_card",
    "write_sweep_card",
]
