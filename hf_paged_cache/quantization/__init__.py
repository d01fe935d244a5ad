"""quantization"""
