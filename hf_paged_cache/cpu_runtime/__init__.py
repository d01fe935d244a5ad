"""The optional CPU model-speed code of the batch generator's packed forwards: oneDNN products (`onednn.py`), Llama
decoder layers run as one fused forward (`fused_layers.py`), and compiled modules (`compiled.py`). Each is swapped
in for a packed forward alone (`forwards.swapped_forwards`); without any, the model runs its own code."""
