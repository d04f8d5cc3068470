"""The protocols the server speaks, one module each with its parsers, routes and OpenAPI paths:
KServe v2 / Open Inference with Triton's extensions (kserve), OpenAI (openai), tokenize/detokenize
(tokenize), TEI-style /predict (predict) and the server's own routes (server). What several of them
share is in parsing (request fields), jsonbody (response bodies), openapi and spec."""
