"""Preference tuning (DPO, IPO, SimPO, ORPO): its config section, pair data, losses and reference model.

What differs from supervised fine-tuning lives here; everything else comes from the shared toolkit.
"""
