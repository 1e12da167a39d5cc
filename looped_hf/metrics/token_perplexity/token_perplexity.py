"""Token-weighted perplexity from summed negative log-likelihoods and token counts.

An ``evaluate`` metric shipped inside looped_hf and loaded by path, so it works offline:

    >>> import evaluate
    >>> from looped_hf.metrics import TOKEN_PERPLEXITY_PATH
    >>> ppl = evaluate.load(TOKEN_PERPLEXITY_PATH)  # doctest: +SKIP
    >>> ppl.compute(nll_sum=[230.1, 118.7], num_tokens=[100, 50])  # doctest: +SKIP
    {'loss': 2.3253..., 'perplexity': 10.23..., 'num_tokens': 150}

Why not the Hub's ``perplexity`` metric: it runs a model itself, and it averages per-sequence
perplexities. A held-out loss for a scaling law is the mean NLL per *token* over the whole set,
so each batch contributes its NLL sum and its token count, and perplexity = exp(sum / count).
The file imports only ``evaluate`` and ``datasets`` (evaluate copies it into its modules cache).
"""

import math

import datasets
import evaluate

_DESCRIPTION = """Token-weighted perplexity: exp(sum of per-token NLL (nats) / number of predicted tokens).
Each prediction is one batch (or sequence): its summed NLL and how many tokens it predicted."""

_KWARGS_DESCRIPTION = """
Args:
    nll_sum: summed next-token negative log-likelihood (nats) of each batch.
    num_tokens: number of predicted tokens in each batch (same length as nll_sum).
Returns:
    loss: token-weighted mean NLL (nats/token).
    perplexity: exp(loss).
    num_tokens: total predicted tokens.
"""

_CITATION = """@misc{looped_hf,
  title = {looped_hf: looped (depth-recurrent) language models for the Hugging Face ecosystem},
  year = {2026}
}"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class TokenPerplexity(evaluate.Metric):
    """Perplexity weighted by tokens, not by batches or sequences."""

    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"nll_sum": datasets.Value("float64"), "num_tokens": datasets.Value("int64")}
            ),
        )

    def _compute(self, nll_sum, num_tokens):
        total = int(sum(num_tokens))
        if total <= 0:
            raise ValueError(
                f"token_perplexity: num_tokens sums to {total}; need at least one predicted token"
            )
        bad = [n for n in num_tokens if n < 0]
        if bad:
            raise ValueError(f"token_perplexity: num_tokens has negative entries {bad[:3]}")
        loss = float(math.fsum(nll_sum)) / total
        # exp overflows a float above ~709 nats: report inf rather than raise.
        perplexity = math.exp(loss) if loss < 709 else math.inf
        return {"loss": loss, "perplexity": perplexity, "num_tokens": total}
