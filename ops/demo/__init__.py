"""The whole system on one box and the workloads that drive it: ``switchyard up --demo``
(:mod:`.up`), the trace load generator (:mod:`.loadgen`), predicted-vs-observed checks
(:mod:`.runcheck`), the vLLM demo (:mod:`.vllm`) and trace prompts as token runs
(:mod:`.trace_tokens`)."""
