"""Audio encoders the alignment aligns too (the omni families): their dummy builders and rows."""

from __future__ import annotations

from typing import Any

import torch

from fsdp_compat.runtime.vlm_families.rows import AudioTower, _index

QWEN_OMNI_AUDIO = AudioTower()


def chunk_mel_inputs(config: Any, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One chunk of 8 zero mel frames and its ``chunk_sample_lengths`` (dots3: three stride-2 convolutions leave
    the 8 frames one, and the chunk's samples, 8 hops, round up to one token; the adapter keeps real tokens only)."""
    audio = config.audio_config
    frames = 8
    return {
        "input_features": torch.zeros(1, int(audio.feature_size), frames, dtype=dtype, device=device),
        "chunk_sample_lengths": _index([frames * int(audio.hop_length)], torch.long, device),
    }


def waveform_inputs(config: Any, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One zero waveform of one token's samples (Muse Spark: a convolutional pyramid over raw audio, whose length
    must be a multiple of ``samples_per_token``, the product of its patch sizes): ``(1, samples_per_token)``."""
    samples = 1
    for size in config.audio_config.patch_sizes:
        samples *= int(size)
    return {"input_values": torch.zeros(1, samples, dtype=dtype, device=device)}


def subsampled_mel_inputs(config: Any, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One clip of twice ``subsampling_factor`` zero mel frames, ``(1, frames, mels)`` (Nemotron-H Omni's Parakeet
    encoder: its stride-2 convolutions subsample by that factor, so that many frames make one token, and its
    conformer convolutions' BatchNorm needs more than one value per channel in training: two tokens. Like a real
    clip, the dummy moves that BatchNorm's running statistics on its rank, buffers, not parameters)."""
    audio = config.audio_config
    frames = 2 * int(audio.subsampling_factor)
    return {"input_features": torch.zeros(1, frames, int(audio.num_mel_bins), dtype=dtype, device=device)}


def masked_mel_inputs(config: Any, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One clip of 4 zero mel frames with its all-valid ``input_features_mask``, ``(1, 4, F)`` (Gemma4's USM
    conformer: two stride-2 convolutions leave one frame; its projection reads F / 4 x the second conv's channels,
    so F is the first conv's channel count, ``subsampling_conv_channels[0]``, 128 mel bins in the released model;
    the forward runs the tower only with the mask)."""
    mels = int(config.audio_config.subsampling_conv_channels[0])
    return {
        "input_features": torch.zeros(1, 4, mels, dtype=dtype, device=device),
        "input_features_mask": torch.ones(1, 4, dtype=torch.bool, device=device),
    }


def dmel_token_inputs(config: Any, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One frame of zero dMel bin tokens, ``(1, 1, n_mel_bins)`` long (Inkling: the audio "tower" embeds each
    frame's quantised mel bins and sums them, one token per frame)."""
    bins = int(config.audio_config.n_mel_bins)
    return {"audio_input_ids": torch.zeros(1, 1, bins, dtype=torch.long, device=device)}


def padded_mel_inputs(config: Any, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One clip of 4 zero mel frames and its mask in the tower's own convention, True where a frame is padding,
    so all False (Gemma3n's USM encoder: two stride-2 convolutions leave one frame; its forward passes the
    processor's mask inverted)."""
    mels = int(config.audio_config.input_feat_size)
    return {
        "input_features": torch.zeros(1, 4, mels, dtype=dtype, device=device),
        "input_features_mask": torch.zeros(1, 4, dtype=torch.bool, device=device),
    }


#: dots3: mel chunks, encoded after images and videos; the forward reads the adapter's ``pooler_output``.
DOTS3_AUDIO = AudioTower(dummy=chunk_mel_inputs, features="pooler_output", after_vision=True)
#: Muse Spark: raw waveforms, after images and videos.
MUSE_SPARK_AUDIO = AudioTower(inputs=("input_values",), dummy=waveform_inputs, features="pooler_output",
                              after_vision=True)  # fmt: skip
#: Nemotron-H Omni: Parakeet mel clips, after images and videos (projected by ``embed_audio`` inside
#: ``get_audio_features``).
NEMOTRON_AUDIO = AudioTower(dummy=subsampled_mel_inputs, features="pooler_output", after_vision=True)
#: Gemma4: USM mel clips, after images and videos; the forward runs the tower only with the mask too.
GEMMA4_AUDIO = AudioTower(inputs=("input_features", "input_features_mask"), dummy=masked_mel_inputs,
                          features="pooler_output", after_vision=True)  # fmt: skip
#: Gemma3n: USM mel clips after images; the forward pads the soft tokens with ``embed_audio``'s hard embedding.
GEMMA3N_AUDIO = AudioTower(inputs=("input_features", "input_features_mask"), dummy=padded_mel_inputs,
                           features="pooler_output", after_vision=True, padding="embed_audio")  # fmt: skip
#: Inkling: dMel bin tokens, after images.
INKLING_AUDIO = AudioTower(inputs=("audio_input_ids",), dummy=dmel_token_inputs, after_vision=True)
