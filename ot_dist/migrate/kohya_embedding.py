"""kohya's textual inversion (train_textual_inversion.py, sdxl_train_textual_inversion.py) as ot_dist's method
embedding: new token vectors in the CLIP text encoders (both of SDXL's), nothing else trained.

kohya: `--token_string` is the new word, `--num_vectors_per_token` its vectors (a word in a caption expands to
them), `--init_word` the text whose token embeddings start them (repeated or cut to the count: ot_dist's
init_token_ids does the same), `--weights` an embedding file to continue from, `--use_object_template` /
`--use_style_template` replace every caption by one of kohya's templates around the token."""

from __future__ import annotations

from ot_dist.errors import ConfigError
from ot_dist.migrate.common import Imported
from ot_dist.migrate.kohya_args import KohyaArgs

TEMPLATES = ("use_object_template", "use_style_template")


def import_embedding(args: KohyaArgs, c: dict, out: Imported) -> None:
    token = args["token_string"]
    if not token:
        raise ConfigError("token_string: not set (kohya needs it: the new word the embedding trains)")
    for key in TEMPLATES:
        if args[key]:
            raise ConfigError(f"{key}: kohya ignores the captions and draws one of its built-in templates around the "
                              "token per sample; ot_dist has no built-in templates (write the lines you want as a "
                              "concept's caption_text, caption_source text: a line is drawn per image and epoch)")
    vectors = args["num_vectors_per_token"]
    c["embedding"] = {"token": token, "vectors": vectors}
    if args["weights"]:  # kohya continues this file (its vectors must number num_vectors_per_token, as here)
        c["embedding"]["init_from"] = args["weights"]
    if args["init_word"]:
        c["embedding"]["init_text"] = args["init_word"]
    else:
        c["embedding"]["init_text"] = "*"
        out.not_honoured.append("init_word: not set: kohya starts the vectors from the rows the text encoder's "
                                "resize_token_embeddings adds; ot_dist starts them from embedding.init_text ('*' "
                                "written)")
    out.notes.append(f"token_string {token!r}: captions that hold it train it, as in kohya; a caption without it "
                     "gets it prepended in ot_dist (kohya trains that caption unchanged, no gradient to the vectors)")
    if vectors > 1:
        out.notes.append(f"num_vectors_per_token {vectors}: kohya names the extra tokens {token}1, {token}2, ...; "
                         f"ot_dist's file is diffusers' layout ({token}_1, ...): load it with its token")
