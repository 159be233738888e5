"""Speculative-decoding proposers (core.contract.spec): one package per proposer."""
