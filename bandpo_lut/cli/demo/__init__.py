"""`bandpo-lut demo`: the toy training tasks that compare BandPO with the baselines."""
