"""One module per transformers `layer_types` name: how the cache stores, reads and serves that kind of layer."""
