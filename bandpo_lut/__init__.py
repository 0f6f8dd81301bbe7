"""bandpo_lut: BandPO trust-region ratio bounds by table lookup, for PPO-family losses."""
__version__ = "0.1.0"
