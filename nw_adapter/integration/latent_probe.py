"""The theory's posterior over a support set, read at every denoiser forward of a generation.

:class:`LatentSupportProbe` hooks a pipeline's denoiser (a forward pre-hook and a forward hook that
only read) and, per step and CFG half, evaluates in the space of x_t (THEORY.md 4b):

- the posterior over the m references ``w_i(x_t) = softmax_i(-||x_t - a_t s_i||^2 / 2 b_t^2)``
  (:func:`~nw_adapter.core.latent_support.reference_log_posterior`), its entropy share ``H(w) / log
  m``, ``n_eff`` and the reference it favours;
- the learned denoiser against the plug-in field: the model's x0 estimate from its output
  (:func:`~nw_adapter.core.latent_support.x0_from_output`) against the NW mean ``m_h(x_t / a_t) =
  sum_i w_i s_i``, as ``||x0 - m_h|| / ||x0 - mean_i s_i||``
  (:func:`~nw_adapter.core.latent_support.relative_distance`) and the two distances themselves;
- with :meth:`LatentSupportProbe.on_step_end` as the pipeline's ``callback_on_step_end``, the
  latent after the last step: its distance to each reference and the nearest one.

The probe changes nothing: it copies what it reads to float64 and returns None from its hooks, so
the generation is bit-identical to one without it. A failure inside it (an unknown noise level, an
odd output) skips that forward and is counted in :attr:`LatentSupportProbe.errors`; the generation
goes on.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from nw_adapter.core.latent_support import (
    posterior_summary,
    reference_log_posterior,
    relative_distance,
    x0_from_output,
)
from nw_adapter.integration.latent_support import LatentSpace, flatten_states
from nw_adapter.integration.processors.selection import batch_halves
from nw_adapter.integration.steps import StepTracker

__all__ = ["LatentSupportProbe"]


def _tensor_output(output: Any) -> torch.Tensor | None:
    """The sample of a denoiser's output (a tuple, a model output with ``sample``, or a tensor)."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, tuple | list) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    sample = getattr(output, "sample", None)
    return sample if isinstance(sample, torch.Tensor) else None


class LatentSupportProbe:
    """The latent-space posterior and the x0-to-NW-mean distance per step and CFG half.

    Args:
        pipe: the pipeline (its scheduler gives the levels, as for the recorder).
        support: ``[m, *state]`` the references' latents in the layout of x_t
            (:func:`~nw_adapter.integration.latent_support.encode_references`).
        space: the pipeline's :class:`~nw_adapter.integration.latent_support.LatentSpace`.

    Attributes:
        rows: one dict per (step, CFG half) seen: ``step``, ``timestep``, ``alpha``, ``sigma``, ``h``,
            ``half``, ``posterior`` (m weights), ``posterior_entropy_share``, ``posterior_n_eff``,
            ``posterior_favoured``, and from the output ``x0_nw_ratio``, ``x0_nw_distance``,
            ``x0_mean_distance``, ``x0_nearest`` (the reference nearest the model's x0); each a mean
            over the half's batch rows.
        final: after a call with :meth:`on_step_end`: ``{"distances": [m], "nearest": r, "latent":
            [B, D] float64}`` of the latent after the last step (distances: the mean over batch rows).
        errors: forwards the probe skipped.
    """

    def __init__(self, pipe: Any, support: torch.Tensor, space: LatentSpace) -> None:
        self.pipe = pipe
        self.space = space
        self.support = flatten_states(support).to(torch.float64)
        self.support_mean = self.support.mean(0)
        self.tracker = StepTracker(pipe)
        self.rows: list[dict[str, Any]] = []
        self.final: dict[str, Any] | None = None
        self.errors = 0
        self._pending: list[dict[str, Any]] = []
        self._x: torch.Tensor | None = None
        self._hooks: list[Any] = []

    # --- hooks ---------------------------------------------------------------------------------

    def attach(self, denoiser: torch.nn.Module | None = None) -> LatentSupportProbe:
        """Register the hooks on ``denoiser`` (default the pipeline's UNet / transformer; the step
        tracker's pre-hook first)."""
        self.detach()
        denoiser = getattr(self.pipe, self.space.denoiser) if denoiser is None else denoiser
        self.tracker.attach(denoiser, timestep_scale=self.space.timestep_scale)
        self._hooks = [
            denoiser.register_forward_pre_hook(self._before, with_kwargs=True),
            denoiser.register_forward_hook(self._after, with_kwargs=True),
        ]
        return self

    def detach(self) -> None:
        """Remove every hook (idempotent)."""
        self.tracker.detach()
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def __enter__(self) -> LatentSupportProbe:
        return self.attach()

    def __exit__(self, *exc: object) -> None:
        self.detach()

    def _before(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        self._pending, self._x = [], None
        try:
            x = kwargs.get("sample", kwargs.get("hidden_states"))
            if x is None and args:
                x = args[0]
            self._x = flatten_states(x.detach()).to(self.support.device, torch.float64)
            self._pending = self._posterior(self._x)
        except Exception:  # noqa: BLE001 - the probe never fails a generation
            self.errors += 1
            self._pending, self._x = [], None

    def _after(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if not self._pending or self._x is None:
            return
        try:
            sample = _tensor_output(output)
            if sample is not None:
                self._distances(flatten_states(sample.detach()).to(self.support.device, torch.float64))
        except Exception:  # noqa: BLE001 - the probe never fails a generation
            self.errors += 1
        for row in self._pending:  # the posterior stays; the per-forward tensors go
            row.pop("_rows", None)
            row.pop("_weights", None)
        self.rows.extend(self._pending)
        self._pending, self._x = [], None

    # --- the quantities ------------------------------------------------------------------------

    def _blocks(self, batch: int) -> list[tuple[str, slice]]:
        state = self.tracker.state
        labels = batch_halves(batch, state, cfg=state.cfg, by_pass=self.space.packed)
        size = batch // len(labels)
        return [(label, slice(i * size, (i + 1) * size)) for i, label in enumerate(labels)]

    def _posterior(self, x: torch.Tensor) -> list[dict[str, Any]]:
        state = self.tracker.state
        alpha, sigma = float(state.alpha), float(state.sigma)
        if not (math.isfinite(alpha) and math.isfinite(sigma) and sigma > 0):
            raise ValueError("unknown noise level")
        log_w = reference_log_posterior(x, self.support, alpha, sigma)  # [B, m]
        rows = []
        for half, rows_of in self._blocks(x.shape[0]):
            summary = posterior_summary(log_w[rows_of])
            mean_w = summary.weights.mean(0)
            rows.append({
                "step": int(state.step), "timestep": float(state.timestep), "alpha": alpha, "sigma": sigma,
                "h": sigma / alpha if alpha > 0 else math.inf, "half": half,
                "posterior": mean_w.tolist(),
                "posterior_entropy_share": float(summary.entropy_share.mean()),
                "posterior_n_eff": float(summary.n_eff.mean()),
                "posterior_favoured": int(mean_w.argmax()),
                "_weights": summary.weights, "_rows": rows_of,
            })  # fmt: skip
        return rows

    def _distances(self, output: torch.Tensor) -> None:
        x = self._x
        for row in self._pending:
            rows_of, weights = row["_rows"], row["_weights"]
            x0 = x0_from_output(output[rows_of], x[rows_of], row["alpha"], row["sigma"], self.space.kind)
            nw_mean = weights @ self.support  # m_h(x_t / a_t) = sum_i w_i s_i
            ratio = relative_distance(x0, nw_mean, self.support_mean)
            nearest = torch.cdist(x0, self.support).mean(0).argmin()
            row.update(
                x0_nw_ratio=float(ratio.mean()),
                x0_nw_distance=float((x0 - nw_mean).norm(dim=-1).mean()),
                x0_mean_distance=float((x0 - self.support_mean).norm(dim=-1).mean()),
                x0_nearest=int(nearest),
            )

    def on_step_end(
        self, pipe: Any, step: int, timestep: Any, callback_kwargs: dict[str, Any]
    ) -> dict[str, Any]:
        """``callback_on_step_end``: keep the distances of the step's latents to the references (the
        last call's are the generation's). Returns ``{}`` (the pipeline's tensors are unchanged)."""
        try:
            latents = callback_kwargs["latents"]
            z = flatten_states(latents.detach()).to(self.support.device, torch.float64)
            distances = torch.cdist(z, self.support).mean(0)
            self.final = {"distances": distances.tolist(), "nearest": int(distances.argmin()), "latent": z}
        except Exception:  # noqa: BLE001 - the probe never fails a generation
            self.errors += 1
        return {}
