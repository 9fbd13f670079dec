"""Training rounds for the online-learning tests (``online_learning.trainer: tests.online_trainers:NAME``)."""

import time

import torch

from specray.training import online as O


def trainable(method: str) -> bool:
    return O.trainable(method)


def fast(bp, serving, traces, cfg):
    """The real round (recipe and gate), with a high learning rate: tiny models learn in seconds."""
    return O.train_round(bp, serving, traces, {**cfg, "steps": 40, "lr": 1e-2, "min_holdout": 2})


def worse(bp, serving, traces, cfg):
    """The real gate, judging a candidate forced worse (every weight scrambled)."""
    fit = O.TRAINERS[bp.method]

    def scramble(module, *args):
        with torch.no_grad():
            for p in module.parameters():
                p.copy_(torch.randn_like(p) * 3)
        return 0.0

    O.TRAINERS[bp.method] = scramble
    try:
        return O.train_round(bp, serving, traces, {**cfg, "min_holdout": 2})
    finally:
        O.TRAINERS[bp.method] = fit


def slow(bp, serving, traces, cfg):
    """A round that takes long (to be killed in the middle of it)."""
    time.sleep(120)
    return O.train_round(bp, serving, traces, cfg)


_rounds = 0
"""Rounds this trainer process has run (a trainer Ray restarts counts from zero again)."""


def worse_then_slow(bp, serving, traces, cfg):
    """The first round judges a candidate forced worse (``worse``); every later one takes long
    (``slow``: to be killed in the middle of it). One replica shows the gate and the faults in turn."""
    global _rounds
    _rounds += 1
    return (worse if _rounds == 1 else slow)(bp, serving, traces, cfg)
