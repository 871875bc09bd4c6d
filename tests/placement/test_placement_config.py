"""``trainer.launcher`` / ``trainer.placement``: what a Ray placement may be, checked at config
load, before Ray starts or any model is built."""

from __future__ import annotations

import pytest

from engine_api.typed_config import load_typed
from posttrain.placement import PlacementConfig, placement_problems
from recipes.ppo import PPOConfig, rl_roles
from recipes.sft import SFTConfig

PPO = "configs/ppo_tiny.yaml"


def _ppo(*overrides: str) -> PPOConfig:
    return load_typed(PPOConfig, PPO, ["trainer.launcher=ray", *overrides])


def test_defaults_put_every_role_on_one_pool():
    cfg = _ppo("actor.kl_coef=0.01")
    assert rl_roles(cfg) == ("actor", "reference", "critic", "rollout")
    assert cfg.trainer.placement.pool_sizes() == {"main": 1}
    assert set(cfg.trainer.placement.assignment(rl_roles(cfg)).values()) == {"main"}


def test_dotted_overrides_build_the_split_layouts():
    cfg = _ppo(
        "trainer.placement.pools.train=2",
        "trainer.placement.pools.critic=1",
        "trainer.placement.pools.gen=1",
        "trainer.placement.roles.critic=critic",
        "trainer.placement.roles.rollout=gen",
    )
    where = cfg.trainer.placement.assignment(rl_roles(cfg))
    assert where == {"actor": "train", "critic": "critic", "rollout": "gen"}  # ppo_tiny: no KL, so no reference


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["trainer.placement.pools.main=0"], "placement.pools.main = 0"),
        (["trainer.placement.roles.critic=nowhere"], "['nowhere']"),
        (["trainer.placement.pools.main=1", "trainer.placement.pools.spare=1"], "placement.pools ['spare']: no role runs there"),
        (["trainer.placement.roles.reference=main"], "places ['reference'], which this run does not have"),
        (["trainer.placement.cpus_per_worker=0"], "placement.cpus_per_worker = 0.0"),
        (["trainer.placement.strategy=SCATTER"], "placement.strategy = 'SCATTER'"),
        (["trainer.launcher=slurm"], "launcher = 'slurm'"),
    ],
)
def test_bad_placements_are_refused_naming_the_key(overrides, needle):
    with pytest.raises(ValueError, match=None) as err:
        _ppo(*overrides)
    assert needle in str(err.value)


def test_a_lora_reference_must_stay_with_the_actor():
    """With LoRA the reference is the actor's own engine (adapters off): it cannot move."""
    with pytest.raises(ValueError) as err:
        _ppo(
            "engine.model.lora.rank=4",
            "actor.kl_coef=0.01",
            "trainer.placement.pools.train=1",
            "trainer.placement.pools.ref=1",
            "trainer.placement.roles.reference=ref",
        )
    assert "placement.roles.reference = 'ref'" in str(err.value) and "fix: placement.roles.reference=train" in str(err.value)
    # Without LoRA the reference is an engine of its own and may live anywhere.
    _ppo("actor.kl_coef=0.01", "trainer.placement.pools.train=1", "trainer.placement.pools.ref=1", "trainer.placement.roles.reference=ref")


def test_sft_has_one_role():
    cfg = load_typed(SFTConfig, "configs/sft_tiny.yaml", ["trainer.launcher=ray", "trainer.placement.pools.main=2"])
    assert cfg.trainer.placement.assignment(("actor",)) == {"actor": "main"}
    with pytest.raises(ValueError, match="places \\['rollout'\\]"):
        load_typed(SFTConfig, "configs/sft_tiny.yaml", ["trainer.launcher=ray", "trainer.placement.roles.rollout=main"])


def test_ray_under_torchrun_is_refused(monkeypatch):
    """With Ray the recipe is the one driver; started by torchrun, every rank would start its own cluster."""
    for key, value in {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match="launcher = 'ray' under torchrun"):
        _ppo()


def test_placement_problems_is_pure():
    p = PlacementConfig(pools={"a": 1, "b": 2}, roles={"rollout": "b"})
    assert placement_problems(p, ("actor", "rollout")) == []
    assert p.assignment(("actor", "critic", "rollout")) == {"actor": "a", "critic": "a", "rollout": "b"}


def test_unlisted_roles_follow_the_actor_wherever_it_is():
    """The actor placed on a pool that is not the first: the roles ``roles`` does not list land
    with it (colocated, as documented), never on the first pool."""
    cfg = _ppo(
        "actor.kl_coef=0.01",
        "trainer.placement.pools.gen=1",
        "trainer.placement.pools.train=2",
        "trainer.placement.roles.actor=train",
        "trainer.placement.roles.rollout=gen",
    )
    assert list(cfg.trainer.placement.pool_sizes()) == ["gen", "train"]
    where = cfg.trainer.placement.assignment(rl_roles(cfg))
    assert where == {"actor": "train", "reference": "train", "critic": "train", "rollout": "gen"}


@pytest.mark.parametrize("address", [None, "10.0.0.9:6379"])
def test_a_ray_start_that_fails_is_named_with_its_knobs(monkeypatch, address):
    """On a busy machine ``ray.init`` of a local instance raises Ray's bare "The current node
    timed out during startup" (a fixed 30 s wait): the run says what it means and what to do
    (start the instance yourself and join it, or torchrun), keeping Ray's error as the cause."""
    import ray

    from posttrain.placement.cluster import RayCluster

    def slow_start(**kwargs):
        raise Exception("The current node timed out during startup. This could happen because some of the raylet failed to startup")

    monkeypatch.setattr(ray, "init", slow_start)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError) as err:
        RayCluster(PlacementConfig(), {"main": ("actor",)}, address, None).__enter__()
    message = str(err.value)
    assert "timed out during startup" in str(err.value.__cause__) and "trainer.launcher=torchrun" in message
    if address is None:
        assert "the local Ray instance did not start" in message and "ray start --head" in message and "trainer.ray_address=auto" in message
        assert "30 s" in message
    else:
        assert f"trainer.ray_address = {address!r}: could not join" in message
