"""For development and the demo: the vLLM-faithful stub upstream."""
