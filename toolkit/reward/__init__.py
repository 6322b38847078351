"""Reward models: a language model with a scalar head trained on preference pairs (Bradley-Terry), its
config section, loss, held-out metrics and scoring. The pairs are the preference recipe's
(toolkit/preference/data.py); everything else comes from the shared toolkit."""
