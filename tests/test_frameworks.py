"""ckptc where people train: in place (``ckptc.apply``), the Hugging Face Trainer, PEFT and Lightning.

Tiny GPT-2 built from a config with random weights (dropout on), a tiny
in-memory dataset, a few steps.  Peaks are measured by the tests themselves:
a forward pre-hook starts :class:`ckptc.meter.StepMeter` (the allocator's
events) with the resident bytes of the model and the call's inputs as its
baseline, and the measurement stops after backward, before the optimizer step.
"""

from __future__ import annotations

import copy
import inspect
import pickle
import warnings
from typing import Any

import pytest
import torch

import ckptc
from ckptc.meter import StepMeter, measure_peak, resident_bytes

transformers = pytest.importorskip("transformers")

SEQ, BATCH, VOCAB = 16, 2, 128


def tiny_gpt2(seed: int = 0) -> Any:
    """GPT-2 as a user builds it (no ckptc-specific settings): dropout on, tied embeddings."""
    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ)
    return transformers.GPT2LMHeadModel(config).train()


def tokens(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))


class StepPeaks:
    """Peaks of training steps measured here, independently of ckptc: the allocator's events
    from :meth:`start` (before forward) to :meth:`stop` (after backward), on top of
    ``baseline`` (the model's parameters, gradients and buffers, and the step's inputs)."""

    def __init__(self) -> None:
        self.peaks: list[int] = []
        self._meter: StepMeter | None = None

    def start(self, baseline: int) -> None:
        self._meter = StepMeter("cpu", baseline).start()

    def stop(self) -> None:
        if self._meter is not None:
            self.peaks.append(self._meter.stop().peak_bytes)
            self._meter = None


def eager_peak(model: torch.nn.Module, kwargs: dict) -> int:
    """Measured peak of one eager step of a copy of ``model``."""
    model = copy.deepcopy(model)
    _, measured = measure_peak(lambda: model(**kwargs).loss.backward(), baseline_bytes=resident_bytes(model, kwargs))
    return measured.peak_bytes


# ckptc's floor on these steps is ~80% of the eager peak: 88% makes it recompute, with room to plan.
BUDGET_FRACTION = 0.88


def batch_kwargs(n: int = BATCH) -> dict[str, torch.Tensor]:
    ids = tokens(n)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


# --------------------------------------------------------------------------- #
# The in-place form                                                            #
# --------------------------------------------------------------------------- #


def test_apply_keeps_the_model_and_trains_like_eager(tmp_path: Any) -> None:
    model, reference = tiny_gpt2(), tiny_gpt2()
    calls: list[str] = []
    model.register_forward_pre_hook(lambda module, args: calls.append("pre"))
    model.register_forward_hook(lambda module, args, out: calls.append("post"))
    signature, keys = inspect.signature(model.forward), list(model.state_dict())
    parameters, attributes = dict(model.named_parameters()), set(vars(model))
    kwargs = batch_kwargs()
    budget = int(BUDGET_FRACTION * eager_peak(model, kwargs))

    assert ckptc.apply(model, budget_bytes=budget) is model
    assert type(model) is transformers.GPT2LMHeadModel
    assert inspect.signature(model.forward) == signature
    assert list(model.state_dict()) == keys and dict(model.named_parameters()) == parameters
    assert model.config.n_layer == 2 and model.lm_head.weight is model.transformer.wte.weight

    for seed in range(3):
        for m in (model, reference):
            m.zero_grad(set_to_none=True)
        calls.clear()
        torch.manual_seed(seed)
        loss = model(**kwargs).loss
        loss.backward()
        assert calls == ["pre", "post"], "hooks run once per call, the call that plans included"
        torch.manual_seed(seed)
        ref_loss = reference(**kwargs).loss
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
        for (name, p), r in zip(model.named_parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.grad, r.grad, rtol=1e-5, atol=1e-6, msg=name)
    plan = ckptc.applied(model).plan
    assert plan is not None and plan.recompute_flops > 0, "the budget was meant to make ckptc recompute"
    assert plan.measured_peak_bytes is not None and plan.measured_peak_bytes <= budget

    # save_pretrained / from_pretrained (tied weights) round trip; copies are plain models.
    model.save_pretrained(tmp_path)
    reloaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path)
    assert list(reloaded.state_dict()) == keys
    for name, value in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], value), name
    assert ckptc.applied(copy.deepcopy(model)) is None  # nn.Module.__getstate__ drops the slot (pickle too)

    # eval and no_grad run the plain model: no plan, nothing recomputed.
    runtime = ckptc.applied(model)._ckptc_runtime
    plans = len(runtime.plans)
    model.eval()
    with torch.no_grad():
        model(**batch_kwargs(3))
    assert len(runtime.plans) == plans

    assert ckptc.remove(model) is model and ckptc.applied(model) is None
    assert set(vars(model)) == attributes  # nothing of ckptc's, nor Dynamo's mark of what it compiled, is left
    model.train()
    calls.clear()
    model(**kwargs).loss.backward()
    assert calls == ["pre", "post"] and len(runtime.plans) == plans


def test_apply_refuses_what_it_cannot_keep_and_leaves_the_model_as_it_was() -> None:
    model = tiny_gpt2()
    with pytest.raises(ValueError, match="budget"):
        ckptc.apply(model, budget_bytes=-1)
    assert ckptc.applied(model) is None
    ckptc.apply(model, budget_gb=1)
    first = ckptc.applied(model)
    with pytest.raises(TypeError, match="ckptc.apply was already called"):
        ckptc.optimize(model, budget_gb=1)
    with pytest.raises(ValueError, match="budget"):
        ckptc.apply(model, budget_bytes=0)
    assert ckptc.applied(model) is first, "a refused re-apply keeps the earlier one"
    ckptc.apply(model, budget_gb=2)  # applying again replaces the options
    assert ckptc.applied(model) is not first and ckptc.applied(model).compiler.budget_bytes == 2 * 1024**3
    copied = pickle.loads(pickle.dumps(model))  # as torch.save: a plain model
    assert type(copied) is type(model) and ckptc.applied(copied) is None

    wrapped = tiny_gpt2()
    fast = ckptc.optimize(wrapped, budget_gb=1)
    with pytest.raises(TypeError, match="already wrapped by ckptc.optimize"):
        ckptc.apply(wrapped, budget_gb=1)  # before: accepted, then the wrapper's next step failed
    assert ckptc.applied(wrapped) is None
    del fast
    ckptc.apply(wrapped, budget_gb=1)  # a wrapper no longer in use is no conflict

    compiled = tiny_gpt2()
    compiled.compile()
    with pytest.raises(TypeError, match="model.compile"):
        ckptc.apply(compiled, budget_gb=1)


def test_wrapper_exposes_the_model_signature_and_unwraps() -> None:
    model = tiny_gpt2()
    fast = ckptc.optimize(model, budget_gb=1)
    assert inspect.signature(fast.forward) == inspect.signature(model.forward)
    assert "labels" in inspect.signature(fast.forward).parameters
    # `.module` as DDP's (transformers' unwrap_model follows it without accelerate), and the
    # model's own attributes (accelerate unwraps only its own and torch's wrappers: use ckptc.apply).
    assert fast.module is model and fast.config is model.config
    assert fast.save_pretrained.__self__ is model
    assert fast.transformer is model.transformer  # submodules come from the shared registry
    with pytest.raises(AttributeError):
        fast.no_such_attribute  # noqa: B018


# --------------------------------------------------------------------------- #
# Hugging Face Trainer                                                         #
# --------------------------------------------------------------------------- #


class TokenDataset(torch.utils.data.Dataset):
    """A tiny in-memory causal-LM dataset of dicts, as a tokenized dataset gives them."""

    def __init__(self, n: int, seed: int) -> None:
        self.ids = tokens(n, seed)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.ids[i]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone(), "text_id": i}


def trainer_for(model: Any, out: Any, peaks: StepPeaks | None = None) -> Any:
    """A Trainer with default arguments apart from the run's length, logging, saving and CPU."""
    args = transformers.TrainingArguments(
        output_dir=str(out),
        max_steps=4,
        per_device_train_batch_size=BATCH,
        per_device_eval_batch_size=3,
        logging_steps=1,
        save_steps=2,
        seed=0,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
    )
    return transformers.Trainer(
        model=model,
        args=args,
        train_dataset=TokenDataset(8, seed=2),
        eval_dataset=TokenDataset(3, seed=3),
        callbacks=[] if peaks is None else [_MeasureSteps(peaks)],
    )


# What a training batch holds when a step begins: input_ids, attention_mask and labels (int64,
# BATCH x SEQ; the Trainer dropped "text_id", which GPT-2's forward does not take) and the
# 0-d int64 num_items_in_batch.
BATCH_BYTES = 3 * BATCH * SEQ * 8 + 8


class _MeasureSteps(transformers.TrainerCallback):
    """Measures steps 3 and 4 (ckptc plans on the first and verifies the second, with its own
    profiler) from the step's beginning to the end of backward (before the optimizer step)."""

    def __init__(self, peaks: StepPeaks) -> None:
        self.peaks = peaks

    def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if state.global_step >= 2:
            self.peaks.start(resident_bytes(model) + BATCH_BYTES)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.peaks.stop()


def losses(trainer: Any) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def test_hugging_face_trainer_trains_saves_reloads_and_resumes_like_the_plain_trainer(tmp_path: Any) -> None:
    plain_peaks = StepPeaks()
    plain = trainer_for(tiny_gpt2(), tmp_path / "plain", plain_peaks)
    plain.train()
    plain_eval = plain.evaluate()
    budget = int(BUDGET_FRACTION * min(plain_peaks.peaks))

    model = ckptc.apply(tiny_gpt2(), budget_bytes=budget)
    peaks = StepPeaks()
    trainer = trainer_for(model, tmp_path / "ckptc", peaks)
    trainer.train()
    assert len(losses(trainer)) == 4
    assert losses(trainer) == pytest.approx(losses(plain), rel=1e-5), "same seed, same losses as the plain Trainer"
    optimized = ckptc.applied(model)
    plan = optimized.plan
    assert plan is not None and plan.recompute_flops > 0
    assert plan.measured_peak_bytes is not None and plan.measured_peak_bytes <= budget
    assert len(peaks.peaks) == 2 and max(peaks.peaks) <= budget, (peaks.peaks, budget)

    # evaluate: eval() and no_grad run the plain model (no new plan; eval batches have another shape).
    plans = len(optimized._ckptc_runtime.plans)
    evaluated = trainer.evaluate()
    assert len(optimized._ckptc_runtime.plans) == plans
    assert evaluated["eval_loss"] == pytest.approx(plain_eval["eval_loss"], rel=1e-5)

    # save_model with tied weights (save_pretrained), reload, and resume from the step-2 checkpoint.
    trainer.save_model(tmp_path / "saved")
    reloaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "saved")
    for name, value in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], value), name
    resumed_model = ckptc.apply(tiny_gpt2(seed=5), budget_bytes=budget)
    resumed = trainer_for(resumed_model, tmp_path / "ckptc")
    resumed.train(resume_from_checkpoint=str(tmp_path / "ckptc" / "checkpoint-2"))
    assert losses(resumed)[-2:] == pytest.approx(losses(plain)[2:], rel=1e-5)
    for name, value in resumed_model.state_dict().items():
        torch.testing.assert_close(value, model.state_dict()[name], rtol=1e-5, atol=1e-6, msg=name)


# --------------------------------------------------------------------------- #
# PEFT / LoRA                                                                  #
# --------------------------------------------------------------------------- #


def lora_gpt2() -> Any:
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True
    )
    return peft.get_peft_model(tiny_gpt2(), config)


def gradient_outputs(record: Any) -> int:
    """How many gradients the backward of a captured joint graph computes (the rest are None)."""
    joint = record.joint_problem
    (output,) = [n for n in joint.joint.graph.nodes if n.op == "output"]
    return sum(g is not None for g in output.args[0][joint.num_fwd_outputs :])


def test_peft_lora_model_plans_only_what_trains_with_eager_gradients() -> None:
    model, reference = lora_gpt2(), lora_gpt2()
    kwargs = batch_kwargs()
    budget = int(BUDGET_FRACTION * eager_peak(model, kwargs))
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)

    assert ckptc.apply(model, budget_bytes=budget) is model
    for seed in range(2):  # LoRA dropout: the same masks as eager, recomputed or not
        for m in (model, reference):
            m.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        loss = model(**kwargs).loss
        loss.backward()
        torch.manual_seed(seed)
        ref_loss = reference(**kwargs).loss
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
        for (name, p), r in zip(model.named_parameters(), reference.parameters(), strict=True):
            if name in trainable:
                torch.testing.assert_close(p.grad, r.grad, rtol=1e-5, atol=1e-6, msg=name)
            else:
                assert p.grad is None, f"{name} is frozen but got a gradient"
    # The backward of the graph holding the parameters computes the adapters' gradients only.
    first = ckptc.applied(model)._ckptc_runtime.step_records()[0]
    assert gradient_outputs(first) == len(trainable)
    plan = ckptc.applied(model).plan
    assert plan.gradient_bytes == sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    assert plan.recompute_flops > 0 and plan.measured_peak_bytes <= budget

    model.zero_grad(set_to_none=True)
    _, measured = measure_peak(lambda: model(**kwargs).loss.backward(), baseline_bytes=resident_bytes(model, kwargs))
    assert measured.peak_bytes <= budget, (measured.peak_bytes, budget)


# --------------------------------------------------------------------------- #
# Lightning                                                                    #
# --------------------------------------------------------------------------- #


def lightning_run(budget_bytes: int | None) -> tuple[list[float], list[int], Any]:
    """Four steps of lightning.Trainer (CPU, 1 device) on a LightningModule holding tiny GPT-2,
    ckptc-applied when a budget is given; the losses and the peaks of steps 3 and 4."""
    lightning = pytest.importorskip("lightning")

    class CausalLM(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = tiny_gpt2()
            if budget_bytes is not None:
                ckptc.apply(self.model, budget_bytes=budget_bytes)
            self.losses: list[float] = []
            self.peaks = StepPeaks()

        def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
            loss = self.model(**batch).loss
            self.losses.append(loss.item())
            return loss

        def on_train_batch_start(self, batch: dict, batch_idx: int) -> None:
            if batch_idx >= 2:  # ckptc plans on the first step and verifies the second
                self.peaks.start(resident_bytes(self, batch))

        def on_before_optimizer_step(self, optimizer: Any) -> None:  # after backward
            self.peaks.stop()

        def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
            super().optimizer_step(*args, **kwargs)
            # Lightning zeroes gradients after the next forward; the budget counts a step
            # from None gradients (and ckptc verifies only such steps): free them here.
            self.zero_grad(set_to_none=True)

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    torch.manual_seed(0)
    module = CausalLM()
    data = [{k: v for k, v in item.items() if k != "text_id"} for item in TokenDataset(8, seed=2)]
    trainer = lightning.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=BATCH))
    return module.losses, module.peaks.peaks, module.model


def test_lightning_trainer_trains_a_ckptc_applied_model_like_eager() -> None:
    plain_losses, plain_peaks, _ = lightning_run(None)
    budget = int(BUDGET_FRACTION * min(plain_peaks))
    losses_, peaks, model = lightning_run(budget)
    assert len(losses_) == 4 and losses_ == pytest.approx(plain_losses, rel=1e-5)
    plan = ckptc.applied(model).plan
    assert plan.recompute_flops > 0 and plan.measured_peak_bytes <= budget
    assert len(peaks) == 2 and max(peaks) <= budget, (peaks, budget)


# --------------------------------------------------------------------------- #
# accelerate                                                                   #
# --------------------------------------------------------------------------- #


def accelerate_run(budget_bytes: int | None) -> tuple[list[float], Any]:
    """Three steps of a plain accelerate loop (CPU) over tiny GPT-2, ckptc-applied when a budget is given."""
    accelerate = pytest.importorskip("accelerate")
    accelerator = accelerate.Accelerator(cpu=True)
    model = tiny_gpt2()
    if budget_bytes is not None:
        ckptc.apply(model, budget_bytes=budget_bytes)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = [{k: v for k, v in item.items() if k != "text_id"} for item in TokenDataset(6, seed=2)]
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH)
    prepared, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    assert prepared is model and accelerator.unwrap_model(prepared) is model
    torch.manual_seed(0)
    losses_ = []
    for batch in loader:
        loss = prepared(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses_.append(loss.item())
    return losses_, model


def test_accelerate_prepares_and_trains_a_ckptc_applied_model_like_eager() -> None:
    budget = int(BUDGET_FRACTION * eager_peak(tiny_gpt2(), batch_kwargs()))
    plain_losses, _ = accelerate_run(None)
    losses_, model = accelerate_run(budget)
    assert len(losses_) == 3 and losses_ == pytest.approx(plain_losses, rel=1e-5)
    plan = ckptc.applied(model).plan
    assert plan.recompute_flops > 0 and plan.measured_peak_bytes <= budget


# --------------------------------------------------------------------------- #
# The Hugging Face loss inside the graph                                       #
# --------------------------------------------------------------------------- #


def causal_lm(name: str) -> Any:
    """Tiny causal LMs as users build them from a config (nothing set for ckptc)."""
    torch.manual_seed(0)
    if name == "gpt2":
        return tiny_gpt2()
    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    small.update(num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ)
    if name == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**small)).train()
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**small)).train()


@pytest.mark.parametrize("name", ["gpt2", "llama", "qwen2"])
def test_the_labels_path_of_causal_lms_is_captured_in_one_graph(name: str) -> None:
    # GPT2LMHeadModel has no loss_type; transformers logs a warning_once in loss_function,
    # a graph break before the loss unless ckptc's capture lets Dynamo skip the log call.
    model = causal_lm(name)
    ids = tokens(BATCH)
    step = ckptc.capture(model, (ids,), {"labels": ids}, measure_scratch=False)
    assert len(step.records) == 1, step.coverage


def test_gradients_zeroed_between_forward_and_backward_are_counted_quietly() -> None:
    """Lightning's loop zeroes gradients after the forward: the last step's gradients are alive
    through it.  A step that starts with gradients resident counts them for the whole step
    (ckptc.planning.account), so this is planned for, not warned about."""
    torch.manual_seed(0)
    model = ckptc.apply(
        torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)), budget_gb=1
    )
    x = torch.randn(16, 32)
    model(x).sum().backward()  # plans
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(x).sum().backward()  # accumulation: planned again counting the resident gradients
        loss = model(x).sum()
        model.zero_grad(set_to_none=True)
        loss.backward()
    runtime = ckptc.applied(model).step_runtime
    assert all(shape.account.gradients_resident for shape in runtime.plans.values())
