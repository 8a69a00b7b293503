"""Privacy attacks on shared updates (MetaVers Figure 3): :mod:`.dlg` (Deep Leakage from
Gradients) and :mod:`.quality` (PSNR/SSIM of a reconstruction)."""
