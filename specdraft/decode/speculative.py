"""Batched speculative decoding: lossless, static shapes, per-row lengths.

Each round: the draft proposes G tokens after the pending token c; the policy verifies
[c, d_1..d_G] in one pass; rejection sampling accepts a prefix of a tokens and emits a correction
or bonus token c' (tau = a + 1 tokens per round). Both caches roll back by setting their lengths.

- EAGLE-3: G - 1 single-entry draft steps chain the draft's own features; after verification the
  draft catches up on the verified positions with the policy's real features in one (G+1)-wide
  pass whose entry a is already the next round's first proposal.
- DFlash / DSpark (block drafts): one draft pass over the block [c, MASK x (W-1)] proposes G
  tokens at once (DSpark's Markov head then walks the block serially on the sampled tokens);
  after verification the policy's taps at the verified positions become the draft's context.

Speculation length: a fixed G every round, or (`schedule.adaptive`) a G in 0..G_max chosen before
every round from a cost model of a round on this machine and the running per-position acceptance
(`decode.cost`); G = 0 is a plain autoregressive step inside the same loop, and the draft does
not run in it: an EAGLE-3 draft keeps the policy's taps of the last W = `Spec.window` plain
steps and takes them in with one W-wide pass when drafting resumes (entries older than that are
skipped: the draft's cache leaves their positions out, its rotary positions stay the policy's);
a block draft writes its context as before. Every choice is lossless.

Every row carries its own PRNG key, split once per round whatever the batch: a row's tokens depend
on its key and its own history only, so gathering the active rows into a smaller batch
(`decode.engine`, compaction) leaves every row's output unchanged.

Shape letters: B batch, S prompt width (BOS + prompt, right-padded), O max new tokens (the
output; N is the taps' letter, as in model/), G draft tokens this round, M = G_max (the most any
round drafts; buffers are sized by it), G1 = G + 1 verified entries, X = O + M + 1 output
buffer, V vocabulary, E width, N taps.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from specdraft.decode.rejection import rejection_sample
from specdraft.decode.sampling import (
  Generation,
  Sampling,
  distribution,
  draw_rows,
  num_active,
  split_rows,
  take,
)
from specdraft.model import dflash, drafts, eagle3
from specdraft.model import policy as pol
from specdraft.tasks.tokenizer import PAD


@functools.partial(
  jax.jit,
  static_argnames=(
    "pcfg",
    "dcfg",
    "max_new_tokens",
    "temperature",
    "top_k",
    "top_p",
    "num_draft",
    "adaptive",
    "sampler",
  ),
)
def generate(
  params,
  dparams,
  pcfg: pol.PolicyConfig,
  dcfg: drafts.DraftConfig,
  prompt_BS,
  prompt_lengths_B,
  key,
  *,
  max_new_tokens: int,
  temperature: float,
  num_draft: int,
  top_k: int = 0,
  top_p: float = 1.0,
  adaptive: bool = False,
  round_seconds=None,
  prior=None,
  sampler=rejection_sample,
) -> Generation:
  """Speculative generation; same interface and output as `autoregressive.generate`.

  The target the policy's tokens follow is the AR sampler's (`sampling.processed_logits`:
  temperature, top-k, top-p): verification compares it with the draft's distribution under the
  same processing, so the output is distributed exactly as AR sampling with these settings.

  `num_draft` is G, or with `adaptive` the most a round drafts (G_max); then `round_seconds`
  [G_max + 1] (the predicted seconds of a round at each G, `decode.cost`) and `prior` (a
  `decode.cost.Acceptance`, or pseudo counts (accepted, reached) [G_max] each) decide G before
  every round (`choose_num_draft`).
  `sampler` is the verification rule (tests swap in a broken one as a negative control).
  `decode.engine.generate` runs the same rounds with finished rows compacted out of the batch.

  stats: policy_passes, row_passes (rows of every policy pass, summed), draft_passes, rounds,
  tau_sum and row_rounds (tau = tau_sum/row_rounds), accept_counts[G_max] and reach_counts[G_max]
  (per-position conditional acceptance = accept/reach), num_draft_counts[G_max + 1] (rounds at each
  G), and per round r < rounds: num_draft_trace[r] (its G) and active_trace[r] (rows generating).
  """
  spec = Spec(pcfg, dcfg, max_new_tokens, num_draft, adaptive, Sampling(temperature, top_k, top_p))
  carry = init(params, dparams, prompt_BS, prompt_lengths_B, key, spec=spec)
  choice = Choice.of(spec, round_seconds, prior)
  carry = run(params, dparams, carry, choice, jnp.int32(0), spec=spec, sampler=sampler)
  return finish(carry, spec)


class Spec(NamedTuple):
  """The static settings of one generation (hashable: part of the compiled program)."""

  pcfg: pol.PolicyConfig
  dcfg: drafts.DraftConfig
  max_new_tokens: int  # O
  num_draft: int  # G, or G_max when adaptive
  adaptive: bool
  sampling: Sampling
  # EAGLE-3 under `adaptive`: the most recent plain-step entries the draft takes in when drafting
  # resumes (older ones are skipped; its cache holds W more entries than the policy's)
  window: int = 8
  # A loop that is not `adaptive` drafts G = num_draft every round, or, when this is >= 0, this
  # G in 0..num_draft every round with buffers sized by num_draft: one stage of G chosen per
  # stage (`decode.engine`, auto_every = stage), whose carry any other such stage continues
  stage_G: int = -1
  # A stage at G = 0 after which no stage drafts: the draft does not take in the emitted tokens
  # (it never proposes again), so its rounds cost a policy step, as AR's do
  stage_plain: bool = False


class Choice(NamedTuple):
  """What an adaptive round's G is chosen from: the predicted seconds of a round at each G at
  this batch [G_max + 1], the acceptance's pseudo counts (accepted, reached) [G_max] (a fixed
  prior plus the counts carried from earlier rollouts), and the fixed prior's own part of them
  (`fixed_*`), which the choice re-centres at the pooled rate (`choose_num_draft`)."""

  round_seconds: jax.Array
  prior_accepted: jax.Array
  prior_reached: jax.Array
  fixed_accepted: jax.Array | float = 0.0
  fixed_reached: jax.Array | float = 0.0

  @classmethod
  def of(cls, spec: Spec, round_seconds, prior, xp=jnp) -> Choice:
    """`prior`: a `decode.cost.Acceptance` (its fixed prior is re-centred), or pseudo counts
    (accepted, reached) taken as they are. `xp`: the array module (numpy for a choice made on
    the host, where a handful of eager device operations would cost more than the choice)."""
    M = spec.num_draft
    zeros = xp.zeros((M,), xp.float32)
    if not spec.adaptive:  # unused: a fixed G
      return cls(xp.ones((M + 1,), xp.float32), zeros, zeros, zeros, zeros)
    if round_seconds is None or prior is None:
      raise ValueError("adaptive speculation needs round_seconds and prior (decode.cost)")
    rs = xp.asarray(round_seconds, xp.float32)
    if rs.shape != (M + 1,):
      raise ValueError(f"round_seconds has shape {rs.shape}; expected ({M + 1},): G = 0..{M}")
    f32 = lambda x: xp.asarray(x, xp.float32)
    if hasattr(prior, "prior_reached"):  # an Acceptance: the fixed prior is known apart
      fixed = (f32(prior.prior_accepted), f32(prior.prior_reached))
      return cls(rs, f32(prior.accepted), f32(prior.reached), *fixed)
    acc, reach = (f32(x) for x in prior)
    return cls(rs, acc, reach, zeros, zeros)


def choose_num_draft(stats: dict, choice: Choice, xp=jnp):
  """The G in 0..G_max that maximises expected tokens per second: E[a + 1 | G] / seconds(G),
  with E[a + 1 | G] = 1 + sum_{i <= G} prod_{j <= i} alpha_j and alpha_j the conditional
  acceptance at position j from the prior's and this generation's counts. The fixed prior's
  pseudo counts at each position are re-centred at the pooled rate of all counts (every
  position's, prior included): a position no round has drafted yet takes the rate the drafted
  ones show rather than the prior's, so a choice that never drafted that deep can still find
  that it pays (with the prior as it is, auto G held at the depth it started from: positions
  it never reached kept the prior's rate). With no counts yet the pooled rate is the prior's.
  Every row still generating rides in the pass, so the active count scales all G alike and
  drops out. `xp`: the array module (numpy on the host: `engine.stage_plan`)."""
  acc = choice.prior_accepted + stats["accept_counts"]
  reach = choice.prior_reached + stats["reach_counts"]
  pool = xp.sum(acc) / xp.maximum(xp.sum(reach), 1e-9)
  acc = acc - choice.fixed_accepted + pool * choice.fixed_reached
  alpha_M = xp.where(reach > 0, acc / xp.maximum(reach, 1e-9), 0.0)
  expected_M1 = 1.0 + xp.concatenate([xp.zeros((1,)), xp.cumsum(xp.cumprod(alpha_M))])
  return xp.argmax(expected_M1 / choice.round_seconds).astype(xp.int32)


def init(params, dparams, prompt_BS, prompt_lengths_B, key, *, spec: Spec) -> dict:
  """The prefill: the loop's carry for a batch (one PRNG key per row, split from `key`)."""
  models = _Models(params, dparams, spec.pcfg, spec.dcfg)
  O, M, sm = spec.max_new_tokens, spec.num_draft, spec.sampling
  keys_B = jax.random.split(key, prompt_BS.shape[0])
  if drafts.is_block(spec.dcfg):
    if M > spec.dcfg.num_proposals:
      raise ValueError(
        f"num_draft={M}: a {spec.dcfg.kind} draft with block_size {spec.dcfg.block_size} proposes "
        f"at most {spec.dcfg.num_proposals} tokens a round"
      )
    return _block_prefill(models, prompt_BS, prompt_lengths_B, keys_B, O=O, M=M, sm=sm)
  extra = spec.window if spec.adaptive else 0
  carry = _prefill(models, prompt_BS, prompt_lengths_B, keys_B, O=O, M=M, sm=sm, extra=extra)
  if spec.adaptive:
    carry = {**carry, **_pending(spec, prompt_BS.shape[0], carry["h"].dtype)}
  return carry


def _pending(spec: Spec, B: int, dtype) -> dict:
  """An EAGLE-3 draft's lag behind the policy under adaptive G: the taps and next tokens of the
  last plain steps it has not taken in (`pend_*`, at most W a row, oldest first) and how many
  positions its cache skips (`skipped`: an entry's position = its slot + skipped)."""
  W, n = spec.window, len(spec.pcfg.taps)
  return {
    "pend_taps": jnp.zeros((B, W, n, spec.pcfg.d_model), dtype),
    "pend_tokens": jnp.zeros((B, W), jnp.int32),
    "pend_len": jnp.zeros((B,), jnp.int32),
    "skipped": jnp.zeros((B,), jnp.int32),
  }


def run(
  params, dparams, carry, choice: Choice, stop_below, *, spec: Spec, sampler=rejection_sample
):
  """Rounds until every row is done or no more than `stop_below` rows still generate (the
  engine then compacts them into a smaller batch)."""
  branch = lambda G: functools.partial(one_round, params, dparams, G=G, spec=spec, sampler=sampler)
  M = spec.num_draft
  cond = lambda c: num_active(c) > stop_below  # stop_below >= 0: some row is active

  def at(g: int):  # one round at G = g, recorded in the stats
    def body(c):
      r, active = c["stats"]["rounds"], num_active(c)
      c = branch(g)(c)
      st = dict(c["stats"])
      st["num_draft_trace"] = st["num_draft_trace"].at[r].set(g, mode="drop")
      st["active_trace"] = st["active_trace"].at[r].set(active, mode="drop")
      st["num_draft_counts"] = st["num_draft_counts"].at[g].add(1)
      return {**c, "stats": st}

    return body

  if not spec.adaptive:
    G = M if spec.stage_G < 0 else spec.stage_G
    if not 0 <= G <= M:
      raise ValueError(f"stage_G={spec.stage_G}: a stage drafts G in 0..num_draft={M}")
    if spec.stage_plain and G != 0:
      raise ValueError(
        f"stage_plain with stage_G={spec.stage_G}: only a G = 0 stage skips the draft"
      )
    return jax.lax.while_loop(cond, at(G), carry)

  # Adaptive: each branch of the switch runs rounds at its G for as long as the choice stays
  # there, so the switch (which may copy the carry, both KV caches included) is entered only when
  # the choice changes, not every round. The rounds run are the same as choosing every round.
  def stay(g: int):
    same = lambda c: cond(c) & (choose_num_draft(c["stats"], choice) == g)
    return lambda c: jax.lax.while_loop(same, at(g), c)

  def body(c):
    G = choose_num_draft(c["stats"], choice)
    return jax.lax.switch(G, [stay(g) for g in range(M + 1)], c)

  return jax.lax.while_loop(cond, body, carry)


def one_round(params, dparams, carry, *, G: int, spec: Spec, sampler=rejection_sample) -> dict:
  """One round at G (0 <= G <= G_max, static) on the loop's carry (`run` switches between these;
  tests drive any schedule of G with it)."""
  models = _Models(params, dparams, spec.pcfg, spec.dcfg)
  O, M, sm = spec.max_new_tokens, spec.num_draft, spec.sampling
  if drafts.is_block(spec.dcfg):  # a block draft's G = 0 round runs no draft pass anyway
    return _block_round(models, carry, O=O, G=G, M=M, sm=sm, sampler=sampler)
  take_in = not (G == 0 and spec.stage_plain and not spec.adaptive)
  return _round(models, carry, O=O, G=G, M=M, sm=sm, sampler=sampler, take_in=take_in)


def finish(carry, spec: Spec) -> Generation:
  """The batch's Generation from the loop's carry."""
  O = spec.max_new_tokens
  lengths_B = carry["out_len"]
  valid_BO = jnp.arange(O)[None] < lengths_B[:, None]
  tokens_BO = jnp.where(valid_BO, carry["out"][:, :O], PAD)
  logprobs_BO = jnp.where(valid_BO, carry["out_lp"][:, :O], 0.0)
  return Generation(tokens_BO, logprobs_BO, lengths_B, carry["stats"])


def _sample_rows(sampler, keys_B, draft_BG, q_probs_BGV, p_probs_BG1V):
  """The verification rule row by row, each row with its own key."""
  if q_probs_BGV is None:
    one = lambda k, d, p: sampler(k, d[None], None, p[None])
    tokens, a = jax.vmap(one)(keys_B, draft_BG, p_probs_BG1V)
  else:
    one = lambda k, d, q, p: sampler(k, d[None], q[None], p[None])
    tokens, a = jax.vmap(one)(keys_B, draft_BG, q_probs_BGV, p_probs_BG1V)
  return tokens[:, 0], a[:, 0]


class _Models:
  """The policy and the draft with their (static) configs, as every piece below needs them."""

  def __init__(self, params, dparams, pcfg, dcfg):
    self.params, self.dparams, self.pcfg, self.dcfg = params, dparams, pcfg, dcfg

  def draft_step(self, dcache, feats_BTE, tokens_BT, skipped_B=None):
    return eagle3.step(
      self.dparams, self.dcfg, self.params["embed"], dcache, feats_BTE, tokens_BT, skipped_B
    )

  def draft_prefill(self, dcache, feats_BTE, tokens_BT, lengths_B):
    return eagle3.prefill(
      self.dparams, self.dcfg, self.params["embed"], dcache, feats_BTE, tokens_BT, lengths_B
    )

  def head_weight(self):
    return pol.head_weight(self.params, self.pcfg)

  def fuse(self, tapped_layers):
    """The draft's input features from the policy's tapped layer outputs (Taps.layers)."""
    return eagle3.fuse(self.dparams, tapped_layers, self.dcfg)


def _policy_prefill(models: _Models, prompt_BS, prompt_lengths_B, keys_B, *, O, M, sm: Sampling):
  """The policy over the prompt and its first token c: (the prompt's taps, the cache capacity,
  the loop carry's policy-side entries). Both drafting paths start here."""
  B, S = prompt_BS.shape
  capacity = S + O + M + 2
  pcache = pol.init_cache(models.pcfg, B, capacity)
  logits_BSV, taps, pcache = pol.prefill(
    models.params, models.pcfg, pcache, prompt_BS, prompt_lengths_B
  )
  keys_B, sub_B = split_rows(keys_B, 2)
  _, logp_BV = distribution(logits_BSV[jnp.arange(B), prompt_lengths_B - 1], *sm)
  c_B = draw_rows(sub_B, logp_BV, sm.temperature)
  out_len_B = jnp.ones((B,), jnp.int32)
  carry = {
    "key": keys_B,
    "pcache": pcache,
    "c": c_B,
    "out": jnp.full((B, O + M + 1), PAD, jnp.int32).at[:, 0].set(c_B),
    "out_lp": jnp.zeros((B, O + M + 1), jnp.float32).at[:, 0].set(take(logp_BV, c_B)),
    "out_len": out_len_B,
    "done": pol.is_stop(models.pcfg, c_B) | (out_len_B >= O),
  }
  return taps, capacity, carry


def _prefill(
  models: _Models, prompt_BS, prompt_lengths_B, keys_B, *, O, M, sm: Sampling, extra: int = 0
) -> dict:
  """Policy over the prompt and its first token; the draft over the prompt, shifted by one
  (entry t pairs the feature of token t with token t+1); the loop's initial carry. The draft's
  cache holds `extra` entries more than the policy's (room for a catch-up window)."""
  taps, capacity, carry = _policy_prefill(
    models, prompt_BS, prompt_lengths_B, keys_B, O=O, M=M, sm=sm
  )
  B, S = prompt_BS.shape
  rows = jnp.arange(B)
  last = prompt_lengths_B - 1
  shifted_BS = jnp.concatenate([prompt_BS[:, 1:], jnp.zeros((B, 1), jnp.int32)], axis=1)
  d_tokens_BS = jnp.where(jnp.arange(S)[None] == last[:, None], carry["c"][:, None], shifted_BS)
  dcache = eagle3.init_cache(models.dcfg, B, capacity + extra)
  d_logits_BSV, d_hidden_BSE, dcache = models.draft_prefill(
    dcache, models.fuse(taps.layers), d_tokens_BS, prompt_lengths_B
  )
  return {
    **carry,
    "dcache": dcache,
    "q_logits": d_logits_BSV[rows, last],
    "h": d_hidden_BSE[rows, last],
    "stats": initial_stats(B, M, O, draft_passes=1),
  }


def initial_stats(B: int, M: int, O: int, *, draft_passes: int) -> dict:
  """The counters after the prefill (one policy pass over B rows)."""
  return {
    "policy_passes": jnp.int32(1),
    "row_passes": jnp.int32(B),
    "draft_passes": jnp.int32(draft_passes),
    "rounds": jnp.int32(0),
    "tau_sum": jnp.int32(0),
    "row_rounds": jnp.int32(0),
    "accept_counts": jnp.zeros((M,), jnp.int32),
    "reach_counts": jnp.zeros((M,), jnp.int32),
    "num_draft_counts": jnp.zeros((M + 1,), jnp.int32),
    # a round emits >= 1 token on every row still generating, so there are < O rounds
    "num_draft_trace": jnp.full((O,), -1, jnp.int32),
    "active_trace": jnp.zeros((O,), jnp.int32),
  }


def _draft_tokens(
  models: _Models, keys_B, q_logits_BV, h_BE, dcache, skipped_B, *, G, sm: Sampling
):
  """G proposals: the first from the carried logits, then G-1 single-entry draft steps (the
  draft samples under the same processing as the target; any draft distribution is exact, a
  close one is accepted more often)."""
  B, V = q_logits_BV.shape
  if G == 0:
    return jnp.zeros((B, 0), jnp.int32), jnp.zeros((B, 0, V), jnp.float32), dcache
  tokens, probs = [], []
  keys = split_rows(keys_B, G)
  for i in range(G):  # G is small and static; unrolled so the last step skips a draft pass
    q_BV, logq_BV = distribution(q_logits_BV, *sm)
    token_B = draw_rows(keys[i], logq_BV, sm.temperature)
    tokens.append(token_B)
    probs.append(q_BV)
    if i < G - 1:
      logits_B1V, h_B1E, dcache = models.draft_step(
        dcache, h_BE[:, None], token_B[:, None], skipped_B
      )
      q_logits_BV, h_BE = logits_B1V[:, 0], h_B1E[:, 0]
  return jnp.stack(tokens, 1), jnp.stack(probs, 1), dcache


def _emit(carry, tokens_BG1, logprobs_BG1, a_B, active_B, *, O, G, pcfg):
  """Writes tokens[0..a] after each row's output, cut at a stop token (`pol.is_stop`) and at O;
  finished rows emit nothing. Returns (out, out_lp, out_len, done)."""
  rows = jnp.arange(tokens_BG1.shape[0])
  idx = jnp.arange(G + 1)[None]
  out_len_B = carry["out_len"]
  is_eos = pol.is_stop(pcfg, tokens_BG1) & (idx <= a_B[:, None])
  first_eos_B = jnp.where(is_eos.any(1), jnp.argmax(is_eos, 1), G + 1)
  count_B = jnp.minimum(jnp.minimum(a_B + 1, first_eos_B + 1), O - out_len_B)
  count_B = jnp.where(active_B, count_B, 0)
  write = lambda buf, vals: jax.vmap(lambda b, v, s: jax.lax.dynamic_update_slice(b, v, (s,)))(
    buf, vals, out_len_B
  )
  keep = idx < count_B[:, None]
  current = carry["out"][rows[:, None], out_len_B[:, None] + idx]
  out = write(carry["out"], jnp.where(keep, tokens_BG1, current))
  out_lp = write(carry["out_lp"], jnp.where(keep, logprobs_BG1, 0.0))
  out_len_B = out_len_B + count_B
  done_B = carry["done"] | (first_eos_B <= a_B) | (out_len_B >= O)
  return out, out_lp, out_len_B, done_B


def _count(stats: dict, active_B, a_B, *, G, M, draft_passes: int) -> dict:
  """Adds one round at G (of at most M), which cost `draft_passes` draft passes, to the decoding
  statistics (only rows still generating count)."""
  st = dict(stats)
  pos = jnp.arange(M)[None]
  st["policy_passes"] += 1
  st["row_passes"] += active_B.shape[0]
  st["draft_passes"] += draft_passes
  st["rounds"] += 1
  st["tau_sum"] += jnp.sum(jnp.where(active_B, a_B + 1, 0))
  st["row_rounds"] += jnp.sum(active_B)
  drafted = active_B[:, None] & (pos < G)
  st["reach_counts"] += jnp.sum(drafted & (a_B[:, None] >= pos), 0)
  st["accept_counts"] += jnp.sum(drafted & (a_B[:, None] > pos), 0)
  return st


def _verify(models: _Models, carry, keys_B, draft_BG, q_probs_BGV, *, O, G, sm: Sampling, sampler):
  """Verify [c, d_1..d_G] in one policy pass, rejection-sample against the probabilities the
  draft sampled from, emit. Returns (tokens_BG1, accepted a_B, the verification pass's taps, the
  policy cache (lengths not yet rolled back), (out, out_lp, out_len, done))."""
  verify_BG1 = jnp.concatenate([carry["c"][:, None], draft_BG], 1)
  logits_BG1V, vtaps, pcache = pol.decode(models.params, models.pcfg, carry["pcache"], verify_BG1)
  p_probs_BG1V, logp_BG1V = distribution(logits_BG1V, *sm)
  q_probs_BGV = None if sm.temperature == 0 else q_probs_BGV
  tokens_BG1, a_B = _sample_rows(sampler, keys_B, draft_BG, q_probs_BGV, p_probs_BG1V)
  logprobs_BG1 = take(logp_BG1V, tokens_BG1)
  emitted = _emit(carry, tokens_BG1, logprobs_BG1, a_B, ~carry["done"], O=O, G=G, pcfg=models.pcfg)
  return tokens_BG1, a_B, vtaps, pcache, emitted


def _round(models: _Models, carry, *, O, G, M, sm: Sampling, sampler, take_in: bool = True):
  """Draft G tokens, verify them in one policy pass, emit, roll back, let the draft catch up.
  G = 0: a plain policy step; under adaptive G (the carry holds `pend_*`) the draft does not run
  (`_plain_step`), otherwise it takes in the emitted token, unless `take_in` is False (a last
  G = 0 stage, `Spec.stage_plain`: the draft never proposes again)."""
  if G == 0 and "pend_len" in carry:
    return _plain_step(models, carry, O=O, M=M, sm=sm, sampler=sampler)
  if "pend_len" in carry:
    carry = _take_in_pending(models, carry)
  skipped_B = carry.get("skipped")
  keys_B, k_draft, k_rej = split_rows(carry["key"], 3)
  pcache, c_B = carry["pcache"], carry["c"]
  n_B = pcache.lengths
  active_B = ~carry["done"]
  rows = jnp.arange(c_B.shape[0])
  draft_BG, q_probs_BGV, dcache = _draft_tokens(
    models, k_draft, carry["q_logits"], carry["h"], carry["dcache"], skipped_B, G=G, sm=sm
  )

  tokens_BG1, a_B, vtaps, pcache, emitted = _verify(
    models, carry, k_rej, draft_BG, q_probs_BGV, O=O, G=G, sm=sm, sampler=sampler
  )
  out, out_lp, out_len_B, done_B = emitted

  # Roll back both caches to the verified prefix [.., c, d_1..d_a]; the draft catches up.
  new_n_B = jnp.where(active_B, n_B + a_B + 1, n_B)
  base = {
    **carry,
    "key": keys_B,
    "pcache": pcache._replace(lengths=new_n_B),
    "c": jnp.where(active_B, tokens_BG1[rows, a_B], c_B),
    "out": out,
    "out_lp": out_lp,
    "out_len": out_len_B,
    "done": done_B,
  }
  if not take_in:  # the draft is left as it is: no later round reads it (only G = 0, `one_round`)
    return {**base, "stats": _count(carry["stats"], active_B, a_B, G=G, M=M, draft_passes=0)}
  slot = (lambda n: n) if skipped_B is None else (lambda n: n - skipped_B)
  catch_up_BG1 = jnp.where(jnp.arange(G + 1)[None] <= a_B[:, None], tokens_BG1, 0)
  d_logits_BG1V, d_hidden_BG1E, dcache = models.draft_step(
    dcache._replace(lengths=slot(n_B)), models.fuse(vtaps.layers), catch_up_BG1, skipped_B
  )
  return {
    **base,
    "dcache": dcache._replace(lengths=slot(new_n_B)),
    "q_logits": d_logits_BG1V[rows, a_B],
    "h": d_hidden_BG1E[rows, a_B],
    "stats": _count(carry["stats"], active_B, a_B, G=G, M=M, draft_passes=max(G, 1)),
  }


def _plain_step(models: _Models, carry, *, O, M, sm: Sampling, sampler):
  """A G = 0 round under adaptive G: one policy pass over the pending token c, no draft pass.
  The policy's taps at c and the token it emits join the draft's pending entries (the oldest
  one dropped, and skipped, once W are pending)."""
  keys_B, _, k_rej = split_rows(carry["key"], 3)
  B = carry["c"].shape[0]
  no_draft = jnp.zeros((B, 0), jnp.int32), jnp.zeros((B, 0, models.pcfg.vocab_size))
  tokens_B1, a_B, vtaps, pcache, emitted = _verify(
    models, carry, k_rej, *no_draft, O=O, G=0, sm=sm, sampler=sampler
  )
  out, out_lp, out_len_B, done_B = emitted
  active_B = ~carry["done"]
  W = carry["pend_tokens"].shape[1]
  pend_len_B = carry["pend_len"]
  drop_B = active_B & (pend_len_B >= W)
  rows = jnp.arange(B)
  at_B = jnp.minimum(pend_len_B, W - 1)

  def append(buf, new):  # drop the oldest entry where full, write the new one after the rest
    sel = drop_B.reshape((B,) + (1,) * (buf.ndim - 1))
    buf = jnp.where(sel, jnp.roll(buf, -1, axis=1), buf)
    return buf.at[rows, at_B].set(jnp.where(active_B.reshape(sel.shape[:-1]), new, buf[rows, at_B]))

  taps_BNE = jnp.moveaxis(vtaps.layers[:, :, 0], 0, 1).astype(carry["pend_taps"].dtype)
  new_B = tokens_B1[:, 0]
  return {
    **carry,
    "key": keys_B,
    "pcache": pcache._replace(lengths=jnp.where(active_B, pcache.lengths, carry["pcache"].lengths)),
    "c": jnp.where(active_B, new_B, carry["c"]),
    "pend_taps": append(carry["pend_taps"], taps_BNE),
    "pend_tokens": append(carry["pend_tokens"], new_B),
    "pend_len": jnp.where(active_B, jnp.minimum(pend_len_B + 1, W), pend_len_B),
    "skipped": carry["skipped"] + drop_B,
    "out": out,
    "out_lp": out_lp,
    "out_len": out_len_B,
    "done": done_B,
    "stats": _count(carry["stats"], active_B, a_B, G=0, M=M, draft_passes=0),
  }


def _take_in_pending(models: _Models, carry):
  """Before a drafting round: if any row has pending entries, the draft takes them in with one
  W-wide pass (slots lengths.., positions shifted by `skipped`) and its next proposal comes from
  the last of them; otherwise nothing runs."""

  def take_in(c):
    P_B, dcache = c["pend_len"], c["dcache"]
    rows = jnp.arange(P_B.shape[0])
    feats_BWE = models.fuse(jnp.moveaxis(c["pend_taps"], 2, 0))
    h_BWE, dc = eagle3.step_hidden(
      models.dparams, models.dcfg, models.params["embed"], dcache, feats_BWE, c["pend_tokens"],
      c["skipped"],
    )  # fmt: skip
    h_BE = h_BWE[rows, jnp.maximum(P_B - 1, 0)]
    has = (P_B > 0)[:, None]
    st = dict(c["stats"])
    st["draft_passes"] += 1
    return {
      **c,
      "dcache": dc._replace(lengths=dcache.lengths + P_B),
      "q_logits": jnp.where(
        has, eagle3.logits_of(models.dparams, h_BE, models.dcfg), c["q_logits"]
      ),
      "h": jnp.where(has, h_BE.astype(c["h"].dtype), c["h"]),
      "pend_len": jnp.zeros_like(P_B),
      "stats": st,
    }

  return jax.lax.cond(jnp.any(carry["pend_len"] > 0), take_in, lambda c: c, carry)


# ----------------------------------------------------------------------------- block drafts


def _block_prefill(models: _Models, prompt_BS, prompt_lengths_B, keys_B, *, O, M, sm: Sampling):
  """Policy over the prompt and its first token c; the prompt's taps become the draft's context
  (positions 0 .. S-1, c's block anchored at S). The loop's initial carry."""
  taps, capacity, carry = _policy_prefill(
    models, prompt_BS, prompt_lengths_B, keys_B, O=O, M=M, sm=sm
  )
  B = prompt_BS.shape[0]
  dcache = dflash.init_cache(models.dcfg, B, capacity)
  dcache = dflash.write_context(
    models.dparams, models.dcfg, dcache, taps.layers, jnp.zeros((B,), jnp.int32), prompt_lengths_B
  )
  return {**carry, "dcache": dcache, "stats": initial_stats(B, M, O, draft_passes=0)}


def _block_tokens(models: _Models, keys_B, h_BWE, c_B, *, G, sm: Sampling):
  """G proposals from one block pass: DFlash samples every slot from its own distribution
  (they do not depend on each other); DSpark walks the block left to right, each slot's logits
  shifted by the Markov term of the token sampled before it (c for the first). Returns the
  tokens [B, G] and the probabilities they were sampled from [B, G, V]. (DSpark without its
  Markov head, markov_rank = 0, samples its slots in parallel like DFlash.)"""
  dp, dcfg = models.dparams, models.dcfg
  w = models.head_weight()
  first = dcfg.first_slot
  keys = split_rows(keys_B, G)
  if not dcfg.has_markov:
    logits_BGV = dflash.slot_logits(dp, dcfg, w, h_BWE[:, first : first + G])
    q_BGV, logq_BGV = distribution(logits_BGV, *sm)
    tokens = [draw_rows(keys[g], logq_BGV[:, g], sm.temperature) for g in range(G)]
    return jnp.stack(tokens, 1), q_BGV
  tokens, probs, prev = [], [], c_B
  for g in range(G):  # G is small and static
    q_BV, logq_BV = distribution(dflash.slot_logits(dp, dcfg, w, h_BWE[:, first + g], prev), *sm)
    prev = draw_rows(keys[g], logq_BV, sm.temperature)
    tokens.append(prev)
    probs.append(q_BV)
  return jnp.stack(tokens, 1), jnp.stack(probs, 1)


def _block_round(models: _Models, carry, *, O, G, M, sm: Sampling, sampler):
  """Propose a block, verify it in one policy pass, emit, roll back; the policy's taps at the
  verified positions become the draft's context (G = 0: a plain policy step, no block pass)."""
  keys_B, k_draft, k_rej = split_rows(carry["key"], 3)
  pcache, c_B = carry["pcache"], carry["c"]
  n_B = pcache.lengths
  active_B = ~carry["done"]
  rows = jnp.arange(c_B.shape[0])
  if G:
    h_BWE = dflash.propose_hidden(
      models.dparams, models.dcfg, models.params["embed"], carry["dcache"], c_B
    )
    draft_BG, q_probs_BGV = _block_tokens(models, k_draft, h_BWE, c_B, G=G, sm=sm)
  else:
    V = models.pcfg.vocab_size
    draft_BG, q_probs_BGV = jnp.zeros((c_B.shape[0], 0), jnp.int32), jnp.zeros((c_B.shape[0], 0, V))

  tokens_BG1, a_B, vtaps, pcache, emitted = _verify(
    models, carry, k_rej, draft_BG, q_probs_BGV, O=O, G=G, sm=sm, sampler=sampler
  )
  out, out_lp, out_len_B, done_B = emitted

  # Verified prefix [.., c, d_1..d_a]: the policy's taps there are the next block's context.
  new_n_B = jnp.where(active_B, n_B + a_B + 1, n_B)
  dcache = dflash.write_context(
    models.dparams, models.dcfg, carry["dcache"], vtaps.layers, n_B, new_n_B
  )
  return {
    "key": keys_B,
    "pcache": pcache._replace(lengths=new_n_B),
    "dcache": dcache,
    "c": jnp.where(active_B, tokens_BG1[rows, a_B], c_B),
    "out": out,
    "out_lp": out_lp,
    "out_len": out_len_B,
    "done": done_B,
    "stats": _count(carry["stats"], active_B, a_B, G=G, M=M, draft_passes=int(G > 0)),
  }
