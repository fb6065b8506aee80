"""Secure aggregation, FedML-free: the server learns the sum of the silos' updates and nothing
else of any one of them. :mod:`.primitives` (maintained libraries' ciphers, key agreement and
secret sharing), :mod:`.fixed_point` (updates as 32-bit words whose sum cannot wrap),
:mod:`.rounds` (one round, each party a pure object)."""
