"""Contract checkers (row subset, packing, regime equality, accuracy, poison) and the R1-R5
parity harness that runs a patched model through the engine and the training forward."""
