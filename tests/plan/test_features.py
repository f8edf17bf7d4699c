"""The feature table (rm.plan.features): every runtime feature names its memory term, step-time term and validation
rule, and a new setting or allowed value without them fails here."""

import dataclasses

from rm.foundations.config import OptimConfig
from rm.plan import features
from rm.settings.validate import CHOICES


def test_every_feature_has_its_shadows():
    assert features.missing() == []


def test_every_shadow_is_a_real_term_or_a_declared_gap():
    for f in features.FEATURES:
        for shadow in (*features._shadows(f.memory), *features._shadows(f.step_time), *features._shadows(f.validation)):
            assert isinstance(shadow, features.Gap) or callable(shadow) or isinstance(shadow, (tuple, dict)), (f.name, shadow)
        for key in f.keys:
            group = key.partition(".")[0]
            assert key in features._keys(group, features.SCHEMAS[group]), key


def test_a_new_attention_implementation_without_a_feature_fails():
    choices = {**CHOICES, "model.attn_implementation": (*CHOICES["model.attn_implementation"], "ring_attention")}
    assert features.missing(choices) == [
        "model.attn_implementation=ring_attention: allowed (rm.settings.validate.CHOICES) but no feature registers it"]


def test_a_new_optimizer_without_a_feature_fails():
    choices = {**CHOICES, "memory_profile.optimizer": (*CHOICES["memory_profile.optimizer"], "lion")}
    assert any(p.startswith("memory_profile.optimizer=lion:") for p in features.missing(choices))


def test_a_new_key_without_a_feature_or_a_reason_fails(monkeypatch):
    @dataclasses.dataclass
    class Train(features.TrainConfig):
        fused_loss: bool = False

    monkeypatch.setitem(features.SCHEMAS, "train", Train)
    assert features.missing() == ["train.fused_loss: in no feature of rm.plan.features and not in NOT_SHADOWED"]


def test_a_new_key_of_a_nested_group_without_a_feature_or_a_reason_fails(monkeypatch):
    @dataclasses.dataclass
    class Optim(OptimConfig):
        lion_beta: float = 0.9

    @dataclasses.dataclass
    class Train(features.TrainConfig):
        optim: Optim = dataclasses.field(default_factory=Optim)

    monkeypatch.setitem(features.SCHEMAS, "train", Train)
    assert features.missing() == ["train.optim.lion_beta: in no feature of rm.plan.features and not in NOT_SHADOWED"]


def test_a_rule_that_does_not_mention_its_key_fails(monkeypatch):
    packing = features.FEATURES[0]
    assert packing.keys == ("train.packing",)
    wrong = dataclasses.replace(packing, validation=(features.rules._attention_warnings,))
    monkeypatch.setattr(features, "FEATURES", (wrong, *features.FEATURES[1:]))
    assert features.missing() == ["packing: no validation rule of it mentions train.packing"]


def test_a_kernel_the_step_time_model_does_not_know_fails(monkeypatch):
    flex = next(f for f in features.FEATURES if f.values == ("flex_attention",))
    monkeypatch.setattr(features, "FEATURES", tuple(dataclasses.replace(f, kernel="square") if f is flex else f
                                                    for f in features.FEATURES))
    assert features.missing() == ["flex-attention: declares kernel 'square', rm.foundations.hardware.attention_kernel"
                                  "('flex_attention') gives 'skips'"]
