"""OpenVINO and OpenVINO GenAI: IR and NNCF builds, the IR runner, the GenAI causal-LM builds and runners."""
