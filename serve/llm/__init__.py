"""Causal LMs: the served model, the generation services behind their queue interface (one at a time,
or continuous batching), the events they hand the routes, and what a request asks of the generated
text: stop strings, logprobs, tools and structured output."""
