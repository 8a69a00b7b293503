"""How close a reconstruction is to its original: PSNR and SSIM (scikit-image's
``peak_signal_noise_ratio`` and ``structural_similarity``).

Images are ``[C, H, W]`` (or ``[1, C, H, W]``) tensors. The reconstruction is clipped to the
pixel range before scoring, as it is when shown: ``[0, 1]`` for images in ``[0, 1]`` (the loaders'
scale, DLG's ``ToTensor`` images), else the range spanned by 0, 1 and the original (standardised
inputs); that range's width is the ``data_range`` of both metrics. Identical images score PSNR
``inf`` and SSIM 1.
"""
from __future__ import annotations

import math

import numpy as np
import torch


def pixel_range(original: torch.Tensor) -> tuple[float, float]:
    """(low, high): [0, 1] widened to the original's own extremes."""
    return min(0.0, float(original.min())), max(1.0, float(original.max()))


def _as_hwc(image: torch.Tensor) -> np.ndarray:
    array = image.detach().cpu().double().numpy()
    array = array.reshape(array.shape[-3:]) if array.ndim == 4 else array
    return np.moveaxis(array, 0, -1)


def reconstruction_quality(original: torch.Tensor, reconstruction: torch.Tensor) -> dict[str, float]:
    """``{"psnr": dB, "ssim": [-1, 1]}`` of the (clipped) reconstruction against the original."""
    from skimage.metrics import peak_signal_noise_ratio, structural_similarity  # here: it imports scipy.stats (0.7 s)

    low, high = pixel_range(original)
    truth = _as_hwc(original)
    guess = np.clip(_as_hwc(reconstruction), low, high)
    mse = float(np.mean((truth - guess) ** 2))
    # scikit-image divides by the MSE; identical images are PSNR = inf by definition
    psnr = math.inf if mse == 0 else float(peak_signal_noise_ratio(truth, guess, data_range=high - low))
    side = min(truth.shape[:2])
    window = min(7, side if side % 2 else side - 1)  # scikit-image's default 7, odd and within the image
    ssim = float(structural_similarity(truth, guess, data_range=high - low, channel_axis=-1, win_size=window))
    return {"psnr": psnr, "ssim": ssim}
