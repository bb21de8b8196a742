"""The notes of the tiny suite's report, one tuple per family (goat_jax/reproduce/suites.py,
``SUITES['tiny']``): how the settings were chosen and how to read the tables. Prose only: a
note never types a measured number (those drift from ``results.json`` the first time a run is
redone). The numbers are in the report's own tables and headline checks, written from the
results each time; a note may name protocol settings (lengths, steps, initial values), which
the configs fix. ``tests/test_reproduce_notes.py`` regenerates a report from changed results
and checks that no measured number appears here."""

LM_NOTES = (
    "Settings were fixed for all encodings before the comparison, from single probe runs that "
    "are not part of this report (docs/experiments.md, 'How the tiny settings were chosen'): "
    "MHA instead of lm_tiny's GQA, because GOAT's prior is per KV head and two priors per layer "
    "cost it perplexity at this size; 64-token training windows and 1000 steps, because GOAT "
    "and RoPE were still improving at 600. The retrieval models use MHA too, chosen from the LM "
    "probes before any MHA retrieval model was trained.",
    "Training length matters for the RoPE claim: at 128 training tokens RoPE's 16x / 1x ratio "
    "stayed below the claim's 3x in the probes (docs/experiments.md), so the RoPE-collapse "
    "threshold is a statement about the shorter window as much as about RoPE.",
    "GOAT's perplexity rises at 2x and then stays flat. The cause, measured on a trained model "
    "(docs/extrapolation.md): the sink MLP learns most heads' recency as a ramp in absolute key "
    "position, and past the training length its inputs leave the range seen in training, so the "
    "ramp turns over and those heads lose their locality. The goat+linear_sink row continues the "
    "ramp linearly past the training length.",
    "The standard passkey prompt is scored zero-shot on the Jargon LMs: byte models of this "
    "size have never seen the task, so the row shows the protocol running (greedy decoding "
    "with the KV cache), not a capability.",
    "RoPE-PI equals RoPE at 1x by construction (interpolation scale L / 64 = 1); beyond, it is "
    "evaluated without the fine-tuning that position interpolation relies on, so it sees "
    "positions at a resolution it never trained on.",
    "Sinusoidal shares lm_tiny's init with every other encoding (no sqrt(d) embedding scale), "
    "so its fixed unit-amplitude encoding dwarfs the 0.02-scale token embeddings at init; read "
    "its in-distribution row with that in mind.",
    "Official synthetic variant: with the official script's settings the baselines use "
    "attention scale 1 (no 1/sqrt(head_dim)), while GOAT's logits are not touched by the "
    "scale, so a gap between GOAT and the baselines in those tables measures the baselines' "
    "scale as much as the positions; the answer-loss line under each table says which models "
    "learned the task at 1x.",
    "The comparators (fire, kerple_log, fox; docs/protocols.md, 'Comparators') train with every "
    "other encoding's settings, untuned, and take part in the headline checks only as "
    "candidates for the best baseline in distribution, except FoX, the rival of the checks "
    "against goat+linear_sink. FIRE's threshold L starts at 512, the reference listing's init: "
    "with 64-token training windows its normalized distance stays well inside [0, 1] in "
    "training, so past 1x its MLP reads inputs it never saw (an ablation with L started at 64 "
    "is in docs/experiments.md, 'Ablations beside the tiny report'). Kerple and FoX have no "
    "such range: a fixed function of the distance, and a gate summed over the tokens between.",
    "FoX's retrieval rows: with the official gate bias b = 0 every forget gate starts at 1/2, "
    "so a key d tokens back starts d ln 2 nats down, and in the earlier seed-0 runs its passkey "
    "and NIAH models never left the chance loss on the answer digits. Decided before these runs "
    "(docs/protocols.md, 'The strongest rival and the linear sink'): the retrieval rows "
    "fox+gate_bias5 start b at 5 (each gate at 0.993), the setting in which FoX learns both "
    "tasks at 1x, and are the rival of the retrieval checks; the official b = 0 rows stay, "
    "labelled fox. FoX's LM row keeps b = 0, under which it learns the text at 1x.",
    "rope+yarn, rope+ntk, rope+logn, rope+yarn+logn and goat+logn train nothing: they are the "
    "rope / goat runs evaluated with the rescaled frequencies (dynamic factor: evaluation "
    "length / 64) and/or log-n scaled content logits, as these methods are used on a trained "
    "RoPE model; goat+learn_frequencies trains GOAT with its Fourier frequencies as parameters. "
    "In the retrieval tables they are the same: RoPE's and GOAT's passkey and NIAH models "
    "evaluated with the rescaling, and GOAT retrieval models trained with learned frequencies.",
    "goat+linear_sink is GOAT with the sink MLP continued linearly past the training length "
    "(model.sink_extrapolation='linear', docs/extrapolation.md). Up to 64 keys it is the "
    "official prior, so its LM trains as goat (the same function; float32 rounding of a "
    "differently compiled program makes the runs drift apart slightly) and differs only past "
    "1x. Its retrieval rows are GOAT's own retrieval models evaluated with the option (the same "
    "weights), so any difference between the goat and goat+linear_sink retrieval rows is the "
    "sink's alone.",
    "Lengths past 64x (docs/protocols.md, 'Extrapolation to 1024x and the 64-wide layout', "
    "decided before these runs): every length scores the same 131,072 held-out bytes (2,048 "
    "windows of 64 bytes at 1x, halving with each doubling, down to 2 windows of 65,536 at "
    "1024x), the same windows for every row and seed. 512x and 1024x are scored only for the "
    "rows whose 64x / 1x ratio was below 1.5 in the report of 2026-12-04 (goat, "
    "goat+linear_sink, goat+learn_frequencies, alibi, kerple_log, fox, nope); a '-' there is a "
    "length not evaluated, not a failure. 128x and longer go through the KV cache in 512-query "
    "chunks (the same logits as one forward, to float32 round-off), which bounds the memory.",
    "goat+bf16, goat+bf16+lane_aligned, goat+bf16+h64 and goat+bf16+h64+lane_aligned weigh the "
    "64-wide layout: GOAT trained in bf16 compute with q/k packed head_dim + 2 wide (official) "
    "or head_dim wide (lane_aligned, which gives the sink's extra bf16 channels two of the "
    "content dimensions). These rows were trained when lane_aligned carved only the channels "
    "the compute dtype needs (one in float32, where the two layouts were then one function); "
    "it now carves bf16's three in every dtype, which leaves these bf16-trained rows as they "
    "are. At the tiny LM's head dim 32, lane_aligned keeps 21 content dims against "
    "the official 23, a larger share carved than at the 125M configs' head dim 64 (53 against "
    "55); the h64 pair (2 heads of 64 instead of 4 of 32) is the comparison at that share. The "
    "bf16 rows differ from the goat row by their compute dtype as well; their checks compare "
    "each lane_aligned row with its own official row only.",
)

VIT_NOTES = (
    "Protocol (docs/protocols.md, 'Tiny vision protocol: objects on a larger canvas', written "
    "before the comparison was run): each test image is pasted unchanged onto a larger black "
    "canvas, so every patch on the object is a training patch and only the number of patches "
    "and the object's place change; the headline check is GOAT against ape from the 1x to the "
    "2x canvas. The upsampling table is the old protocol's, kept as the secondary table; "
    "results.json keeps every seed's numbers.",
    "NoPE is the control. It cannot tell positions apart, so its drop on the canvas is what the "
    "canvas costs without any position encoding: four times as many patches at 2x, most of "
    "them background, share the CLS token's attention. An encoding's drop is to be read "
    "against NoPE's, not against zero.",
    "GOAT's prior starts uniform (0 nats of range) and its per-block range after training is "
    "in the canvas section below, per checkpoint; how far it moves can differ several-fold "
    "between seeds, which the per-seed values in results.json show.",
    "The split of GOAT's prior into kappa(q - k) + u(k) is exact by construction (the residual "
    "is printed below). In the last block only the CLS token's output reaches the classifier, "
    "and the CLS query has zero Fourier features, so kappa gets no gradient there and stays at "
    "its uniform init while u(j), which the CLS query does see, can grow. The shift-invariance "
    "checks move query and key together, so they measure u alone (kappa cannot change under a "
    "joint shift).",
    "Upsampling (the old protocol, secondary table): ape's table is bicubically resized, so it "
    "reads interpolated positions, while the other encodings read positions they never saw.",
    "rope_mixed (learned per-head 2D frequencies, Heo et al. 2024, initialized as the paper). "
    "The paper's 224 -> 384 px gain is for ImageNet ViT-S after 300 epochs "
    "(configs/vit_s16_imagenet.py); this is a 4-epoch model on small images.",
    "Train images/s are medians of runs that shared the 2 cores with other jobs, so they are "
    "not comparable between encodings here; benchmarks/vit.md has the side-by-side step times.",
)

DNA_NOTES = (
    "Protocol (docs/protocols.md, 'Tiny DNA protocol: long windows', written before the "
    "comparison was run): 512-base windows (half the official 1024), 1500 steps of 16 windows "
    "(~3 epochs of the training 90% of MG1655), evaluation at 1x..8x on held-out MG1655, "
    "E. coli DH1 and two human genomes, GC agreement over 1,600 windows. GOAT and RoPE are the "
    "pair every check compares; ALiBi and NoPE are table rows that train after every check's "
    "runs.",
    "The models sit a little below the uniform 2 bits per base: a 2-layer model trained on "
    "12M bases of one bacterium learns its short-range statistics (specialised DNA compressors "
    "do better on E. coli). Differences between encodings are therefore small in bits; the "
    "seeds establish their sign, not that they matter for a genome model.",
    "DH1 is another E. coli strain, never trained on: the same checks there test that the "
    "MG1655 numbers are not a property of the training genome alone.",
    "Human DNA scored by models trained on one bacterium measures the mismatch of the genomes "
    "more than positions (a row above 2 bits is worse than a uniform guess); those rows are not "
    "judged.",
    "GC agreement: with 1,600 windows the 95% interval of each r is about +-0.05 "
    "(docs/protocols.md). The two no-model references (prompt, halves) use the same windows in "
    "every seed; samples of 200 bases at temperature 1 from models this close to uniform carry "
    "little of the window's GC.",
    "Memory is compiled, not trained, so it has no seeds and is judged by its sign; GOAT's "
    "extra prior channels are what it pays for, and the table's note says where the paper's "
    "difference comes from.",
)
