"""What a model leaves on disk that the lowest layers read: the cache folder, a GGUF file's
tensor index, the small records of what transformers resolved.  Imports nothing of the
package, so settings, hardware detection and the tokenizer can read them."""
