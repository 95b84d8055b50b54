"""What a training step is, as one frozen value built once: `StepSpec`.

Every training step (SFT, draft distillation, co-training) is the same program shape: the policy's
forward on sequence shards (`train/sequence.py`: unsharded, over the 'cp' ring, or as a pipeline
over 'pp'), an objective on its final hidden state and taps, gradients, one optimizer update. What
varies between them, and between layouts, is static: the model configs, the loss's settings (the
co-training loss's GRPO settings and the rollouts' sampling), the compute knobs and where it runs
(mesh, pipeline). `StepSpec` holds exactly that, so a step is `step(state, batch, spec)` and the
functions under it take the spec rather than a dozen keywords.

    spec = StepSpec.from_config(config, "rl", pcfg=pcfg, dcfg=dcfg, tx=tx, mesh=mesh)
    state, metrics = jax.jit(functools.partial(step.cotrain_step, spec=spec))(state, batch)

`StepSpec.of(...)` builds one from the same keywords the steps once took (tests and notebooks).
"""

from __future__ import annotations

import dataclasses

from specdraft.decode.sampling import Sampling


@dataclasses.dataclass(frozen=True)
class Compute:
  """How the step computes, never what: the vocabulary chunk of the logits (0 = the whole row at
  once), query rows and keys per attention tile, per-layer rematerialisation of the policy, and
  the attention kernel (`attn_kernel`: None for the XLA tiles, or a
  `attention.kernels.KernelSettings` for the fused Pallas block in every training attention:
  the policy's trunk, the ring, the draft's branch rows)."""

  vocab_chunk: int = 0
  attn_tile: int = 512
  remat: bool = False
  attn_kernel: object = None

  @classmethod
  def from_config(cls, compute_cfg, attention_cfg=None) -> Compute:
    """From the config's `compute` and `attention` sections."""
    from specdraft.attention.kernels.flash import KernelSettings

    return cls(
      vocab_chunk=int(compute_cfg.vocab_chunk),
      attn_tile=int(compute_cfg.attn_tile),
      remat=bool(compute_cfg.remat),
      attn_kernel=KernelSettings.from_config(attention_cfg),
    )


@dataclasses.dataclass(frozen=True)
class RLLoss:
  """The co-training loss L_RL(theta) + lam * L_draft(phi): GRPO's clipping, aggregation and KL
  settings, the distribution the rollouts sampled (the RL log-probs and the entropy are of it),
  lam (a float, or a traced scalar where one program serves several), whether the draft trains,
  and the sequence-mean-token-scale budget (`max_tokens`; None: the batch's length)."""

  eps_low: float
  eps_high: float
  aggregation: str
  beta: float = 0.0
  kl_estimator: str = "k3"
  sampling: Sampling = Sampling()
  lam: float = 1.0
  train_draft: bool = True
  max_tokens: int | None = None

  @classmethod
  def from_config(
    cls, rl_cfg, *, lam: float | None = None, train_draft: bool = True, max_tokens=None
  ) -> RLLoss:
    """From the config's `rl` section (`lam` defaults to rl.lam)."""
    return cls(
      eps_low=float(rl_cfg.eps_low),
      eps_high=float(rl_cfg.eps_high),
      aggregation=str(rl_cfg.aggregation),
      beta=float(rl_cfg.beta),
      kl_estimator=str(rl_cfg.kl_estimator),
      sampling=Sampling(
        float(rl_cfg.temperature), int(rl_cfg.get("top_k", 0)), float(rl_cfg.get("top_p", 1.0))
      ),
      lam=float(rl_cfg.lam) if lam is None else lam,  # a traced lam is kept (one program)
      train_draft=bool(train_draft),
      max_tokens=None if max_tokens is None else int(max_tokens),
    )


@dataclasses.dataclass(frozen=True)
class StepSpec:
  """One training step's static description.

  pcfg, dcfg: the policy's and the draft's configs (dcfg None for SFT). rl: the co-training
  loss's settings (None outside RL). compute: `Compute`. mesh: the device mesh (None: one
  device); its 'cp' axis is the context-parallel ring. pipeline: a `model.pipelined.PipelineSpec`
  (None: no pipeline; else the policy runs over the mesh's 'pp' axis and the objective on the
  last stage). tx: the step's optimizer. stop_tap_gradient: the draft's loss reaches the policy
  only through its logits' targets, never through the taps (True), or through the taps too."""

  pcfg: object
  dcfg: object = None
  rl: RLLoss | None = None
  compute: Compute = Compute()
  mesh: object = None
  pipeline: object = None
  tx: object = None
  stop_tap_gradient: bool = True

  @classmethod
  def of(
    cls,
    pcfg,
    dcfg=None,
    rl_cfg=None,
    *,
    tx=None,
    lam: float | None = None,
    train_draft: bool = True,
    stop_tap_gradient: bool = True,
    max_tokens: int | None = None,
    mesh=None,
    pipeline=None,
    vocab_chunk: int = 0,
    attn_tile: int = 512,
    remat: bool = False,
    attn_kernel=None,
  ) -> StepSpec:
    """A spec from loose settings (`rl_cfg`: a config's `rl` section, for the co-training loss;
    `lam` defaults to rl_cfg.lam)."""
    rl = None
    if rl_cfg is not None:
      rl = RLLoss.from_config(rl_cfg, lam=lam, train_draft=train_draft, max_tokens=max_tokens)
    return cls(
      pcfg=pcfg,
      dcfg=dcfg,
      rl=rl,
      compute=Compute(int(vocab_chunk), int(attn_tile), bool(remat), attn_kernel),
      mesh=mesh,
      pipeline=pipeline,
      tx=tx,
      stop_tap_gradient=bool(stop_tap_gradient),
    )

  @classmethod
  def from_config(
    cls, config, phase: str, *, pcfg, dcfg=None, tx=None, mesh=None, pipeline=None
  ) -> StepSpec:
    """The spec of `phase` ("sft", "draft" or "rl") of a run of `config`: the compute section,
    and for "rl" the rl section with the draft trained when rollout.draft is "cotrained" and
    the aggregation's budget rl.max_new_tokens (0: decode.max_new_tokens)."""
    if phase not in ("sft", "draft", "rl"):
      raise ValueError(f"phase={phase!r}: expected one of 'sft', 'draft', 'rl'")
    rl = None
    if phase == "rl":
      c = config
      rl = RLLoss.from_config(
        c.rl,
        train_draft=c.rollout.draft == "cotrained",
        max_tokens=c.rl.max_new_tokens or c.decode.max_new_tokens,
      )
    return cls(
      pcfg=pcfg,
      dcfg=None if phase == "sft" else dcfg,
      rl=rl,
      compute=Compute.from_config(config.compute, config.get("attention")),
      mesh=mesh,
      pipeline=pipeline,
      tx=tx,
    )

  def replace(self, **changes) -> StepSpec:
    return dataclasses.replace(self, **changes)
