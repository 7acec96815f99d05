"""Drafter upload validation: one pure function that the submit form, the REST API and
``python -m worker validate`` all call before anything is stored. No Django here.

    with validate_checkpoint(uploads, "draft_model", target, max_total_bytes=...) as ckpt:
        ...store each ckpt.files[i].path under ckpt.files[i].name, record ckpt.content_sha256...

``uploads`` is a list of ``(name, source, size)``: ``source`` is a readable binary file
object (a Django ``UploadedFile`` works) or a path. Either several loose files, or exactly
one ``.zip`` / ``.tar.gz`` / ``.tgz`` archive.

Rules (each refusal is a ``Problem(file, field, message, member)``; all of them are
collected and raised together as ``CheckpointRejected``):

Files
- Only ``.json`` and ``.safetensors`` files are accepted, and the pickled weights of the
  published formats (``pytorch_model.bin`` and its shards, ``medusa_lm_head.pt``), which are
  converted to safetensors in a sandboxed child (formats.py). Every other pickle-capable
  file (``.bin .pt .pth .pkl .pickle .ckpt .joblib``) is refused by name, never opened, with
  how to convert it; code is refused as remote code (``.py`` files are dropped, never run,
  from a speculators checkpoint, which ships its config class as code); anything else is
  refused with the list of what is accepted.
- Files that published checkpoints carry beside the weights (``names.EXTRA_FILES``: model
  cards, git attributes, training and optimizer state, tokenizer copies) are dropped unread,
  with a note (``ValidatedCheckpoint.intake``).
- Operating-system junk in archives or uploads (``__MACOSX/``, ``.DS_Store``, ``._*``
  AppleDouble files, ``Thumbs.db``, ``desktop.ini``) is IGNORED: it is never extracted,
  not part of the checkpoint or of its hash, and listed in ``ValidatedCheckpoint.ignored``.
  Its names still pass the path and file-type checks below, so it cannot smuggle a link.
- Names (loose or archive members): no absolute paths (``/x``, ``C:x``), no ``..``
  component, no backslashes or control characters, at most 16 levels and 255 characters.
  ``./`` and doubled slashes are normalised away. Duplicate names are refused.
- Archive members must be regular files (or directories, which are skipped): symlinks,
  hard links, devices, FIFOs, sparse and encrypted members are refused.
- If every member sits under one top-level folder (``mydrafter/config.json``), that folder
  is stripped, so a zipped folder and the loose files give the same names and hash.
- Size: the sum of file sizes may not exceed ``max_total_bytes``. For archives it is
  checked on the declared sizes before anything is extracted (zip) or before each member
  is written (tar), AND on the bytes actually decompressed, counted while streaming; a
  .tar.gz stream is also capped as a whole (headers included). The archive itself may not
  exceed the limit either. At most ``max_files`` files.
- ``ngram`` takes no files (its parameters: ``validate_method_params``).

Published formats (formats.py): a ``speculators`` config is read by vLLM's own code and the
method's rules apply to the flat draft config vLLM builds; a FasterDecoding Medusa config
gets the target's ``hidden_size`` and ``vocab_size``. ``ValidatedCheckpoint.intake`` says
which format came in and what was done.

The modules: ``names`` (name and extension rules), ``archives`` (extraction), ``formats``
(published formats; ``speculators`` and ``convert`` run in worker/sandbox.py's child),
``contents`` (the extracted files), ``validate`` (the entry points), ``results`` (what goes
in and out), ``cli`` (``python -m worker validate``). The safetensors header rules are those of
worker/safetensors_header.py; the config.json rules are each method's, in worker/methods.

Safetensors (headers only; no tensor is ever loaded)
- 8-byte little-endian header length N with 2 <= N <= min(file size - 8, 100 MB); the
  header is UTF-8 JSON, an object, without duplicate keys; ``__metadata__`` is a str->str
  map; every other entry has exactly ``dtype`` (a known safetensors dtype), ``shape`` (a
  list of non-negative ints) and ``data_offsets`` ([begin, end] ints, begin <= end);
  end - begin == product(shape) * dtype size; sorted by begin, the tensors tile the data
  section exactly: no overlap, no gap, the last end is the data section's length; at
  least one tensor.
- Tensor names are unique across files; ``model.safetensors.index.json`` (if present)
  maps tensors to files that are present and that hold them.
- Parameter count: elements of floating-point tensors (index buffers such as EAGLE-3's
  ``d2t``/``t2d`` are not parameters).

config.json (required at the top level for every method with weights)
- Remote code is refused: an ``auto_map`` key (anywhere, in any .json file), a truthy
  ``trust_remote_code``, or a code file among the uploads.
- ``architectures`` allowed for the method, as vLLM 0.32 loads them
  (vllm/model_executor/models/registry.py ``_SPECULATIVE_DECODING_MODELS`` and
  vllm/transformers_utils/configs/eagle.py, which renames ``XForCausalLM`` to
  ``EagleXForCausalLM`` / ``Eagle3XForCausalLM``): see each method's ``*ARCHITECTURES``.
  Medusa configs may omit ``architectures`` (vLLM defaults it to ``MedusaModel``).
- ``vocab_size`` equals the target's (medusa: when present). eagle3: a
  ``draft_vocab_size`` different from ``vocab_size`` needs a ``d2t`` tensor of shape
  [draft_vocab_size] with an integer dtype.
- ``hidden_size`` equals the target's for eagle, eagle3 (``target_hidden_size`` when the
  head declares one), medusa and mtp heads.
- Sane sizes: 1 <= num_hidden_layers <= 200, num_attention_heads >= 1 dividing
  hidden_size, num_key_value_heads >= 1 dividing num_attention_heads, positive
  intermediate_size/head_dim; eagle3 ``eagle_aux_hidden_state_layer_ids`` within the
  target's layers.
- draft_model: ``model_type`` matches the architecture; the tensors agree with the
  config: ``model.embed_tokens.weight`` is [vocab_size, hidden_size], ``lm_head.weight``
  (or ``tie_word_embeddings``), and ``model.layers.i`` for exactly i < num_hidden_layers.

The duplicate-hash and rate-limit checks need the database and are the caller's; the
caller gets ``content_sha256`` (``checkpoint_content_sha256``: every tensor's name, dtype,
shape and bytes, and config.json as canonical JSON; file names, shards and formatting do
not count).
Validation writes only inside its own temporary directory, removed on failure; on success
the caller removes it with ``cleanup()`` (or by using the result as a context manager).
"""
from worker.checkpoint.results import (CheckpointFile, CheckpointRejected, Problem, TargetFacts,
                                       Upload, ValidatedCheckpoint)
from worker.checkpoint.validate import (check_files_given, checkpoint_content_sha256,
                                        validate_checkpoint, validate_method_params)

__all__ = ["CheckpointFile", "CheckpointRejected", "Problem", "TargetFacts", "Upload",
           "ValidatedCheckpoint", "check_files_given", "checkpoint_content_sha256", "validate_checkpoint",
           "validate_method_params"]
