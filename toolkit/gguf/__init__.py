"""GGUF files for llama.cpp, Ollama and LM Studio: a run's merged model converted and quantized by
llama.cpp's own converter and quantizer, with an Ollama Modelfile beside it."""
