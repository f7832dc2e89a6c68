"""The paper's update rule (Section 5.3, 5.4) and the jitted steps: the learning
rate schedule, label-smoothed cross entropy, Adam, the train state, and the
train / eval steps over a device mesh (data parallel: the batch sharded on
"data"; the state replicated, or split with FSDP; gradient accumulation
reducing the gradients once per update)."""

from __future__ import annotations

import contextlib
import functools
import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from transformer.model import prng
from transformer.model.transformer import Transformer, TransformerConfig, init_params, shift_right
from transformer.runtime import parallel




def learning_rate_schedule(d_model: int, warmup_steps: int, scale: float = 1.0):
  """Section 5.3: lrate = scale * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5).

  `step` counts updates from 1 (optax passes 0 for the first update).
  """
  def schedule(count):
    step = jnp.asarray(count, jnp.float32) + 1.0
    return scale * d_model ** -0.5 * jnp.minimum(step ** -0.5, step * warmup_steps ** -1.5)
  return schedule


# The budget schedule's plan in the train state (`state["schedule"]`, int32 [3]),
# fixed by the training loop as the run's speed becomes known (time_budget.py):
# [warm-up steps, the step the decay starts at, decay steps]; 0 = not known yet.
WARMUP, DECAY_START, DECAY_STEPS = 0, 1, 2


def budget_learning_rate(step, plan, peak: float):
  """The learning rate of update `step` (0-based) under a budget's plan: a
  linear warm-up over plan[WARMUP] updates, `peak` until plan[DECAY_START],
  then a linear decay reaching 0 after plan[DECAY_STEPS] more (warm-up,
  stable, decay: the shape whose length is chosen late, when the decay starts;
  see time_budget.BudgetPlanner). 0 until the warm-up's length is known (the
  first, compiling, update)."""
  step = jnp.asarray(step, jnp.float32)
  plan = jnp.asarray(plan, jnp.float32)
  warmup = jnp.where(plan[WARMUP] > 0, (step + 1.0) / jnp.maximum(plan[WARMUP], 1.0), 0.0)
  decay_end = plan[DECAY_START] + plan[DECAY_STEPS]
  decay = jnp.where(plan[DECAY_STEPS] > 0,
                    (decay_end - step) / jnp.maximum(plan[DECAY_STEPS], 1.0), 1.0)
  return peak * jnp.clip(jnp.minimum(warmup, decay), 0.0, 1.0)


def learning_rate(schedule, state: dict):
  """The learning rate of `state`'s next update: the paper's schedule of the
  step, or with a budget's plan in the state, `budget_learning_rate`."""
  if "schedule" in state:
    return schedule(state["step"], state["schedule"])
  return schedule(state["step"])


def cross_entropy_sums(logits: jax.Array, targets: jax.Array, weights: jax.Array,
                       label_smoothing: float) -> dict[str, jax.Array]:
  """Label-smoothed cross entropy (Section 5.4), without a one-hot matrix.

  The smoothed target puts 1 - eps on the reference token and eps / (V - 1) on
  every other token. Its cross entropy with softmax(logits) is
      -(conf - low) * log p[target] - low * sum_v log p[v],
  and sum_v log p[v] = sum_v logits[v] - V * logsumexp(logits), so only the
  log-sum-exp, the row sum and one gathered logit per token are needed. The
  entropy of the smoothed target is subtracted, so a perfect model scores 0.

  Args:
    logits: float32 `[batch, length, vocab]`.
    targets: int `[batch, length]`.
    weights: `[batch, length]`, 1 on real tokens, 0 on padding.
    label_smoothing: eps.
  Returns:
    Sums over real tokens: "loss" (smoothed), "nll" (plain negative
    log-likelihood), "correct" (argmax hits), "weight" (number of tokens).
  """
  vocab = logits.shape[-1]
  confidence = 1.0 - label_smoothing
  low = label_smoothing / (vocab - 1)
  entropy = -(confidence * math.log(confidence)
              + (vocab - 1) * low * math.log(low + 1e-20))
  log_z = jax.nn.logsumexp(logits, axis=-1)
  target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  log_p_target = target_logit - log_z
  sum_log_p = jnp.sum(logits, axis=-1) - vocab * log_z
  loss = -(confidence - low) * log_p_target - low * sum_log_p - entropy
  weights = weights.astype(jnp.float32)
  # argmax == target, written as "no logit beats the target's" (ties count as hits)
  correct = target_logit >= jnp.max(logits, axis=-1)
  return {"loss": jnp.sum(loss * weights), "nll": jnp.sum(-log_p_target * weights),
          "correct": jnp.sum(correct * weights), "weight": jnp.sum(weights)}


SCHEDULES = ("paper", "budget")


def make_optimizer(config: ml_collections.ConfigDict, d_model: int):
  """(optimizer, schedule): Adam with the paper's betas/epsilon (+ optional
  clipping) and config.lr_schedule: "paper", its warm-up schedule of the step
  (inside the optimizer), or "budget", `budget_learning_rate` with peak
  config.learning_rate, whose plan is in the train state: the optimizer is
  then Adam's direction alone and `train_step` scales it by the rate."""
  if config.get("lr_schedule", "paper") == "budget":
    peak = float(config.learning_rate)
    schedule = lambda step, plan: budget_learning_rate(step, plan, peak)
    adam = optax.scale_by_adam(b1=config.adam_b1, b2=config.adam_b2, eps=config.adam_eps)
  else:
    schedule = learning_rate_schedule(d_model, config.warmup_steps, config.learning_rate_scale)
    adam = optax.adam(schedule, b1=config.adam_b1, b2=config.adam_b2, eps=config.adam_eps)
  if config.get("grad_clip_norm", 0.0):
    return optax.chain(optax.clip_by_global_norm(config.grad_clip_norm), adam), schedule
  return adam, schedule




def create_train_state(model_config: TransformerConfig, optimizer, seed: int) -> dict:
  """{"step", "params", "opt_state", "rng"}: everything a resumed run needs."""
  init_rng, dropout_rng = jax.random.split(jax.random.key(seed))
  params = init_params(model_config, init_rng)
  return {"step": jnp.array(0, jnp.int32), "params": params,
          "opt_state": optimizer.init(params), "rng": dropout_rng}


def with_budget_plan(state: dict) -> dict:
  """`state` with an unknown budget plan (`budget_learning_rate`), for
  config.lr_schedule="budget": it is saved and restored with the state, so a
  resumed run follows the plan its first run fixed."""
  return dict(state, schedule=jnp.zeros(3, jnp.int32))


def init_train_state(config: ml_collections.ConfigDict, model_config: TransformerConfig,
                     optimizer, mesh) -> tuple[dict, dict]:
  """(the initial train state on the mesh, its shardings): replicated, or with
  `config.state_sharding="fsdp"` every large array split over the devices
  (`parallel.state_shardings`); created in place, never whole on one device."""
  def create():
    state = create_train_state(model_config, optimizer, config.seed)
    return with_budget_plan(state) if config.get("lr_schedule") == "budget" else state
  shardings = parallel.state_shardings(
      jax.eval_shape(create), mesh, config.get("state_sharding", "replicated"))
  return jax.jit(create, out_shardings=shardings)(), shardings


def _forward_sums(params, batch, model_config, label_smoothing, dropout_rng):
  """Loss sums of one (micro)batch; dropout on when `dropout_rng` is given."""
  decoder_inputs = shift_right(batch["targets"], model_config.bos_id,
                               batch["targets_segment_ids"])
  model = Transformer(model_config, deterministic=dropout_rng is None)
  logits = model.apply(
      {"params": params}, batch["inputs"], decoder_inputs,
      inputs_segment_ids=batch["inputs_segment_ids"],
      decoder_segment_ids=batch["targets_segment_ids"],
      inputs_positions=batch["inputs_positions"],
      decoder_positions=batch["targets_positions"],
      rngs=None if dropout_rng is None else {"dropout": dropout_rng})
  weights = batch["targets_segment_ids"] > 0
  return cross_entropy_sums(logits, batch["targets"], weights, label_smoothing)


def train_step(state: dict, batch: dict, *, model_config: TransformerConfig,
               optimizer, schedule, label_smoothing: float, mesh=None,
               param_specs=None) -> tuple[dict, dict]:
  """One update from `batch` (arrays `[accumulation, rows, length]`).

  Gradients of the micro-batches are summed (a `lax.scan`) and divided by the
  number of target tokens of the whole batch, so accumulating k micro-batches
  is the same update as one batch k times larger.

  With a `mesh`, the rows are split over its "data" axis and the gradients
  are computed per device (`shard_map`): each device sums its rows' gradients
  over the micro-batches and the devices add theirs up once per update, one
  float32 all-reduce. (Under plain `jit` XLA reduces them inside the
  accumulation loop, once per micro-batch: tests/test_benchmarks.py counts them.)
  Dropout masks are the same either way: those of the whole batch.

  `param_specs` (PartitionSpecs like the params; default: replicated) is the
  parameters' layout on the mesh: with FSDP (`parallel.state_shardings`) each
  device gathers the whole parameters once per update and the gradients are
  reduce-scattered back to the same layout, once per update too.
  """
  step_rng = jax.random.fold_in(state["rng"], state["step"])
  gradients = functools.partial(_gradient_sums, model_config=model_config,
                                label_smoothing=label_smoothing)
  if mesh is None:
    grads, sums = gradients(state["params"], batch, step_rng)
  else:
    if param_specs is None:
      param_specs = jax.tree.map(lambda _: P(), state["params"])
    grads, sums = jax.shard_map(
        functools.partial(gradients, axis_name=parallel.DATA_AXIS, param_specs=param_specs),
        mesh=mesh, in_specs=(param_specs, P(None, parallel.DATA_AXIS), P()),
        out_specs=(param_specs, P()),
    )(state["params"], batch, step_rng)

  updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
  rate = learning_rate(schedule, state)
  if "schedule" in state:  # (a budget: the optimizer gave Adam's direction alone)
    updates = jax.tree.map(lambda u: -rate * u, updates)
  params = optax.apply_updates(state["params"], updates)
  metrics = dict(sums, grad_norm=optax.global_norm(grads), learning_rate=rate)
  new_state = dict(state, step=state["step"] + 1, params=params, opt_state=opt_state)
  return new_state, metrics


def _gradient_sums(params, batch: dict, step_rng, *, model_config: TransformerConfig,
                   label_smoothing: float, axis_name: str | None = None,
                   param_specs=None):
  """(gradients of the loss per target token, loss sums) of `batch`
  `[accumulation, rows, length]`, one micro-batch at a time. With `axis_name`
  this runs in `shard_map` on one device's rows and its slice of the params
  (`param_specs`), and the result is reduced over the axis once, at the end."""
  weight = jnp.sum(batch["targets_segment_ids"] > 0)
  if axis_name is not None:
    weight = jax.lax.psum(weight, axis_name)
    # Differentiate this device's copy of the whole parameters, so that the
    # gradient stays local until the end (differentiating the replicated /
    # sharded input itself would all-reduce / reduce-scatter it at every
    # micro-batch: the transposes of JAX's implicit broadcast and of all_gather).
    params = jax.tree.map(functools.partial(_whole, axis_name=axis_name), params, param_specs)
  total_weight = jnp.maximum(weight, 1).astype(jnp.float32)

  def micro_step(grads, micro):
    index, micro_batch = micro
    def loss_fn(params):
      sums = _forward_sums(params, micro_batch, model_config, label_smoothing,
                           jax.random.fold_in(step_rng, index))
      return sums["loss"] / total_weight, sums
    micro_grads, sums = jax.grad(loss_fn, has_aux=True)(params)
    return jax.tree_util.tree_map(jnp.add, grads, micro_grads), sums

  num_micro = batch["targets"].shape[0]
  zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
  with (prng.rows_sharded_over(axis_name) if axis_name else contextlib.nullcontext()):
    if num_micro == 1:
      grads, sums = micro_step(zeros, (0, jax.tree_util.tree_map(lambda x: x[0], batch)))
    else:
      grads, sums = jax.lax.scan(micro_step, zeros, (jnp.arange(num_micro), batch))
      sums = jax.tree_util.tree_map(jnp.sum, sums)
  if axis_name is not None:
    grads = jax.tree.map(functools.partial(_reduce, axis_name=axis_name), grads, param_specs)
    sums = jax.lax.psum(sums, axis_name)
  return grads, sums


def _sharded_axis(spec: P, axis_name: str) -> int | None:
  return next((i for i, name in enumerate(spec) if name == axis_name), None)


def _whole(param, spec: P, *, axis_name: str):
  """This device's copy of a whole parameter, from its slice (`spec`)."""
  axis = _sharded_axis(spec, axis_name)
  if axis is None:
    return jax.lax.pcast(param, axis_name, to="varying")
  return jax.lax.all_gather(param, axis_name, axis=axis, tiled=True)


def _reduce(grad, spec: P, *, axis_name: str):
  """The sum over devices of a local gradient, laid out as `spec`."""
  axis = _sharded_axis(spec, axis_name)
  if axis is None:
    return jax.lax.psum(grad, axis_name)
  return jax.lax.psum_scatter(grad, axis_name, scatter_dimension=axis, tiled=True)


def eval_step(params, batch, *, model_config: TransformerConfig,
              label_smoothing: float) -> dict:
  """Loss sums of an evaluation batch (`[rows, length]`), dropout off."""
  return _forward_sums(params, batch, model_config, label_smoothing, None)


def summarize_sums(sums: dict) -> dict[str, float]:
  """Per-token averages from summed metrics."""
  weight = max(float(sums["weight"]), 1.0)
  out = {"loss": float(sums["loss"]) / weight, "nll": float(sums["nll"]) / weight,
         "accuracy": float(sums["correct"]) / weight}
  out["perplexity"] = float(np.exp(min(out["nll"], 50.0)))
  return out


def jit_train_step(config, model_config, optimizer, schedule, mesh, state_shardings):
  """(the jitted step: (state, global batch `[accumulation, rows, length]`) ->
  (state, metrics), the batch's sharding): `train_step` over the mesh, the
  batch sharded on rows, the state laid out as `state_shardings` and donated."""
  batch_sharding = NamedSharding(mesh, P(None, "data"))
  param_specs = jax.tree.map(lambda s: s.spec, state_shardings["params"])
  step_fn = jax.jit(
      lambda s, b: train_step(s, b, model_config=model_config, optimizer=optimizer,
                              schedule=schedule, label_smoothing=config.label_smoothing,
                              mesh=mesh, param_specs=param_specs),
      in_shardings=(state_shardings, batch_sharding),
      out_shardings=(state_shardings, parallel.replicated(mesh)), donate_argnums=0)
  return step_fn, batch_sharding


def jit_local_train_step(config, model_config, optimizer, schedule, mesh, state_shardings):
  """`jit_train_step` taking this process's batch of numpy arrays."""
  step_fn, batch_sharding = jit_train_step(config, model_config, optimizer, schedule, mesh,
                                           state_shardings)
  return lambda state, batch: step_fn(state, global_batch(batch, batch_sharding))


def global_batch(batch: dict[str, np.ndarray], sharding) -> dict[str, jax.Array]:
  return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in batch.items()}
