"""Trainer integrations: BandPO as a one-line switch in the trainer you already run.

- `bandpo_lut.integrations.verl`: importing it registers the verl policy loss ``"bandpo"``
  (``actor_rollout_ref.actor.policy_loss.loss_mode=bandpo``) and provides `BandPolicyLossConfig`,
  the ``policy_loss`` config that carries the band settings.
- `bandpo_lut.integrations.trl`: `BandGRPOConfig` / `BandGRPOTrainer`, TRL's GRPO with the band in
  place of its per-token clip.
- `bandpo_lut.integrations.skyrl`: importing it registers the SkyRL (skyrl-train) policy loss
  ``"bandpo"`` (``trainer.algorithm.policy_loss_type=bandpo``), configured by
  ``trainer.algorithm.band_*``.
- `bandpo_lut.integrations.openrlhf`: `BandPolicyLoss` (OpenRLHF's ``PolicyLoss`` with the band), and
  `bandpo_lut.integrations.openrlhf_launcher`, the command line
  ``python -m bandpo_lut.integrations.openrlhf_launcher <train_ppo_ray args> --band.delta ...``,
  which activates it in every Ray worker.

No submodule is imported here: each needs its framework installed (pinned versions in
``requirements-integrations.txt``, ``requirements-skyrl.txt`` and ``requirements-openrlhf.txt``), and
importing this package must not require any of them.
"""

__all__ = ["verl", "trl", "skyrl", "openrlhf", "openrlhf_launcher"]
