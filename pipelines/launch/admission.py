"""Admission of a training job as the cluster decides a create: what the API server and the Kubeflow webhooks refuse.

:func:`refusals` returns every reason the cluster would refuse a job, in the order the API server meets them:

1. metadata as for every object (name a DNS-1123 subdomain, namespace a DNS-1123 label, label keys and values);
2. the CRD's ``openAPIV3Schema`` (on the object with the schema's defaults applied, as decoding does);
3. the CRD's CEL rules (``x-kubernetes-validations``) at every level, ``self`` bound to that node, evaluated with
   cel-python (RE2 regexes, as the API server); transition rules (those naming ``oldSelf``) only run on updates
   and are skipped here, where every job is a create;
4. the validating webhook of the operator that owns the kind: training-operator v1.8.1 for a PyTorchJob
   (pkg/webhooks/pytorch/pytorchjob_webhook.go at the commit infra/terraform pins), Trainer v2.3.0 for a TrainJob
   (pkg/webhooks/trainjob_webhook.go and the torch and jobset plugins' ``Validate``).

What only the cluster knows is not checked: that the referenced ClusterTrainingRuntime exists (the TrainJob
webhook refuses a job whose runtime is missing), and a runtime's containers where it is not one this module knows.
Each :class:`Refusal` names the field, the message the cluster would give and the rule that refuses it.
"""
from __future__ import annotations

import copy
import functools
import re
from dataclasses import dataclass
from pathlib import Path

import re2
import yaml

TRAINING_OPERATOR = "training-operator v1.8.1 webhook"
TRAINER = "Trainer v2.3.0 webhook"
API_SERVER = "API server"


@dataclass(frozen=True)
class Refusal:
    path: str  # the field, dotted ('<root>' for the object)
    message: str  # what the cluster says
    rule: str  # which check says it: the schema, a CEL rule's text, or a webhook's rule

    def __str__(self) -> str:
        return f"{self.path}: {self.message} [{self.rule}]"


def refusals(job: dict, crd_path: Path | None = None) -> list[Refusal]:
    """Every reason the cluster would refuse to create ``job``: metadata, then (with a CRD) its schema and CEL
    rules, then the owning operator's webhook."""
    obj = copy.deepcopy(job)
    out = metadata_refusals(obj)
    if crd_path is not None:
        crd = load_crd(Path(crd_path), obj.get("kind"))
        version = crd_version(crd, str(obj.get("apiVersion", "")).rpartition("/")[2])
        schema = version["schema"]["openAPIV3Schema"]
        obj = with_defaults(obj, schema)
        if "status" in (version.get("subresources") or {}):
            obj.pop("status", None)  # with the status subresource a create's status is dropped
        out += schema_refusals(obj, schema) + cel_refusals(obj, schema)
    return out + webhook_refusals(obj)


# ---- the CRD: schema and defaults

@functools.lru_cache(maxsize=8)
def load_crd(path: Path, kind: str | None = None) -> dict:
    """The CRD at ``path``; one that is not YAML, not a CustomResourceDefinition, or (with ``kind``) of another
    kind is a ValueError naming the file."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: a CRD of 6,000 lines in 0.5 s, not 5
    try:
        crd = yaml.load(path.read_text(), Loader=loader)
        crd_kind = crd["spec"]["names"]["kind"] if crd.get("kind") == "CustomResourceDefinition" else None
        if not isinstance(crd["spec"]["versions"], list):
            raise TypeError("spec.versions is not a list")
    except (OSError, yaml.YAMLError, KeyError, TypeError, AttributeError) as e:
        why = " ".join(str(e).split())  # one line: YAML errors span several
        raise ValueError(f"{path} is not a readable CustomResourceDefinition ({type(e).__name__}: {why})") from None
    if crd_kind is None or (kind is not None and crd_kind != kind):
        raise ValueError(f"{path} defines {crd_kind or 'no CustomResourceDefinition'}, not {kind}")
    return crd


def crd_version(crd: dict, version: str | None = None) -> dict:
    """The CRD's entry for ``version`` (None: its first); a version it does not have is a ValueError."""
    versions = crd["spec"]["versions"]
    for v in versions:
        if version is None or v["name"] == version:
            return v
    raise ValueError(f"the {crd['spec']['names']['kind']} CRD has no version {version!r}")


def with_defaults(value, schema: dict):
    """``value`` with the schema's ``default`` values filled in where absent (objects that exist only)."""
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        out = {k: with_defaults(v, props.get(k) or _additional(schema)) for k, v in value.items()}
        for k, sub in props.items():
            if k not in out and "default" in sub:
                out[k] = with_defaults(copy.deepcopy(sub["default"]), sub)
        return out
    if isinstance(value, list):
        return [with_defaults(v, schema.get("items") or {}) for v in value]
    return value


def _additional(schema: dict) -> dict:
    extra = schema.get("additionalProperties")
    return extra if isinstance(extra, dict) else {}


def schema_refusals(obj: dict, schema: dict) -> list[Refusal]:
    import jsonschema

    v = jsonschema.Draft7Validator(schema)
    return [Refusal(".".join(str(p) for p in e.absolute_path) or "<root>", e.message, "CRD schema")
            for e in sorted(v.iter_errors(obj), key=lambda e: [str(p) for p in e.absolute_path])]


# ---- CEL rules (x-kubernetes-validations)

_OLD_SELF = re.compile(r"\boldSelf\b")


def cel_refusals(value, schema: dict, path: str = "", root: bool = True) -> list[Refusal]:
    """The failed CEL rules of ``schema`` and its sub-schemas on ``value`` (present fields only, as the API
    server: a rule on an absent field does not run)."""
    out = []
    for rule in schema.get("x-kubernetes-validations") or []:
        r = _rule_refusal(rule, value, schema, path, root)
        if r is not None:
            out.append(r)
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        for k, v in value.items():
            sub = props.get(k) if k in props else _additional(schema)
            if sub:
                out += cel_refusals(v, sub, f"{path}.{k}" if path else k, root=False)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, v in enumerate(value):
            out += cel_refusals(v, schema["items"], f"{path}[{i}]", root=False)
    return out


def _rule_refusal(rule: dict, value, schema: dict, path: str, root: bool) -> Refusal | None:
    import celpy

    expr = rule["rule"]
    if _OLD_SELF.search(expr):
        return None  # a transition rule: runs on updates only
    where = (path + rule.get("fieldPath", "")).lstrip(".") or "<root>"
    self_ = to_cel(_root_view(value) if root else value, schema)
    try:
        ok = _program(expr).evaluate({"self": self_})
    except (celpy.CELEvalError, celpy.CELParseError) as e:
        return Refusal(where, f"rule could not be evaluated: {_first_line(e)}", f"CEL rule: {expr}")
    if ok is True or (isinstance(ok, celpy.celtypes.BoolType) and bool(ok)):
        return None
    return Refusal(where, _message(rule, self_), f"CEL rule: {expr}")


def _message(rule: dict, self_) -> str:
    """The rule's messageExpression's value, else its message, else the API server's 'failed rule: …'."""
    import celpy

    if rule.get("messageExpression"):
        try:
            return str(_program(rule["messageExpression"]).evaluate({"self": self_}))
        except (celpy.CELEvalError, celpy.CELParseError):
            pass
    return rule.get("message") or f"failed rule: {rule['rule']}"


def _root_view(obj: dict) -> dict:
    """At the root a rule sees only metadata.name and metadata.generateName (the API server's restriction)."""
    meta = obj.get("metadata") or {}
    return {**obj, "metadata": {k: meta[k] for k in ("name", "generateName") if k in meta}}


def _first_line(e: Exception) -> str:
    arg = e.args[0] if e.args else e
    return str(arg).splitlines()[0][:200]


@functools.lru_cache(maxsize=512)
def _program(expr: str):
    import celpy

    env = celpy.Environment()
    return env.program(env.compile(expr), functions=k8s_functions())


CEL_RESERVED = frozenset("true false null in as break const continue else for function if import let loop package "
                         "namespace return var void while".split())


def cel_field(name: str) -> str:
    """A property name as Kubernetes exposes it to CEL: reserved words and '_', '.', '-', '/' escaped."""
    if name in CEL_RESERVED:
        return f"__{name}__"
    return (name.replace("__", "__underscores__").replace(".", "__dot__").replace("-", "__dash__")
            .replace("/", "__slash__"))


def to_cel(value, schema: dict):
    """A JSON value as the CEL value Kubernetes gives a rule: object properties escaped (:func:`cel_field`),
    map keys as they are, date-time and duration strings as timestamps and durations."""
    from celpy import celtypes

    if isinstance(value, dict):
        props = schema.get("properties") or {}
        return celtypes.MapType({celtypes.StringType(cel_field(k) if k in props else k):
                                 to_cel(v, props.get(k) or _additional(schema)) for k, v in value.items()})
    if isinstance(value, list):
        return celtypes.ListType([to_cel(v, schema.get("items") or {}) for v in value])
    if isinstance(value, bool):
        return celtypes.BoolType(value)
    if isinstance(value, int):
        return celtypes.IntType(value)
    if isinstance(value, float):
        return celtypes.DoubleType(value)
    if isinstance(value, str):
        return _string(value, schema.get("format"))
    return value  # null


def _string(value: str, fmt: str | None):
    from celpy import celtypes

    try:
        if fmt == "date-time":
            return celtypes.TimestampType(value)
        if fmt == "duration":
            return celtypes.DurationType(value)
    except ValueError:
        pass  # not of its format: the schema check says so
    return celtypes.StringType(value)


@functools.lru_cache(maxsize=1)
def k8s_functions() -> dict:
    """The Kubernetes CEL string-library and regex functions celpy lacks (cel-go's ext.Strings, k8s regex)."""
    from celpy import celtypes

    S, L = celtypes.StringType, celtypes.ListType
    return {
        "lowerAscii": lambda s: S(s.lower()), "upperAscii": lambda s: S(s.upper()), "trim": lambda s: S(s.strip()),
        "replace": lambda s, a, b, n=-1: S(s.replace(a, b, int(n))),
        "split": lambda s, sep, n=-1: L([S(p) for p in s.split(sep, int(n))]),
        "join": lambda xs, sep="": S(str(sep).join(str(x) for x in xs)),
        "indexOf": lambda s, sub, start=0: celtypes.IntType(s.find(sub, int(start))),
        "lastIndexOf": lambda s, sub: celtypes.IntType(s.rfind(sub)),
        "substring": lambda s, a, b=None: S(s[int(a):] if b is None else s[int(a):int(b)]),
        "charAt": lambda s, i: S(s[int(i):int(i) + 1]),
        "find": lambda s, pat: S((m.group(0) if (m := re2.search(pat, s)) else "")),
        "findAll": lambda s, pat: L([S(m.group(0)) for m in re2.finditer(pat, s)]),
    }


# ---- what the API server checks on every object's metadata

DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
DNS1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
QUALIFIED_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
HTTP_PATH = re.compile(r"[A-Za-z0-9/\-._~%!$&'()*+,;=:]+")


def dns1035_errors(name: str) -> list[str]:
    """apimachinery's IsDNS1035Label: what is wrong with ``name`` as a DNS-1035 label (empty when nothing)."""
    errs = []
    if len(name) > 63:
        errs.append("must be no more than 63 characters")
    if not DNS1035_LABEL.fullmatch(name):
        errs.append("a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with an "
                    "alphabetic character, and end with an alphanumeric character (regex used for validation is "
                    "'[a-z]([-a-z0-9]*[a-z0-9])?')")
    return errs


def metadata_refusals(obj: dict) -> list[Refusal]:
    meta = obj.get("metadata") or {}
    name, ns = str(meta.get("name", "")), str(meta.get("namespace", ""))
    out = []
    if not name or len(name) > 253 or not DNS1123_SUBDOMAIN.fullmatch(name):
        out.append(Refusal("metadata.name", f"{name!r}: must be a lowercase RFC 1123 subdomain of at most 253 "
                           "characters", f"{API_SERVER}: object name"))
    if ns and (len(ns) > 63 or not DNS1123_LABEL.fullmatch(ns)):
        out.append(Refusal("metadata.namespace", f"{ns!r}: must be a lowercase RFC 1123 label of at most 63 "
                           "characters", f"{API_SERVER}: namespace"))
    for k, v in (meta.get("labels") or {}).items():
        prefix, _, key = str(k).rpartition("/")
        if not (len(key) <= 63 and QUALIFIED_NAME.fullmatch(key)) or (prefix and not _subdomain(prefix)):
            out.append(Refusal(f"metadata.labels[{k}]", "not a valid label key", f"{API_SERVER}: label key"))
        if v and not (len(str(v)) <= 63 and QUALIFIED_NAME.fullmatch(str(v))):
            out.append(Refusal(f"metadata.labels[{k}]", f"{v!r} is not a valid label value",
                               f"{API_SERVER}: label value"))
    return out


def _subdomain(s: str) -> bool:
    return len(s) <= 253 and bool(DNS1123_SUBDOMAIN.fullmatch(s))


# ---- the operators' validating webhooks

def webhook_refusals(obj: dict) -> list[Refusal]:
    kind = obj.get("kind")
    if kind == "PyTorchJob":
        return pytorchjob_refusals(obj)
    if kind == "TrainJob":
        return trainjob_refusals(obj)
    return []


def pytorchjob_refusals(job: dict) -> list[Refusal]:
    """training-operator v1.8.1's validatePyTorchJob: a DNS-1035 name, spec.nprocPerNode or (deprecated)
    elasticPolicy.nProcPerNode but not both, then the replica specs."""
    out = []
    name = str((job.get("metadata") or {}).get("name", ""))
    if errs := dns1035_errors(name):
        out.append(Refusal("metadata.name", f"{name!r} should match: {', '.join(errs)}",
                           f"{TRAINING_OPERATOR}: NameIsDNS1035Label"))
    spec = job.get("spec") or {}
    if (spec.get("elasticPolicy") or {}).get("nProcPerNode") is not None and spec.get("nprocPerNode") is not None:
        out.append(Refusal("spec.elasticPolicy.nProcPerNode", "Forbidden: must not be used with spec.nprocPerNode",
                           f"{TRAINING_OPERATOR}: elasticPolicy.nProcPerNode xor nprocPerNode"))
    return out + pytorch_replica_refusals(spec.get("pytorchReplicaSpecs"))


def pytorch_replica_refusals(specs) -> list[Refusal]:
    base, rule = "spec.pytorchReplicaSpecs", f"{TRAINING_OPERATOR}: validatePyTorchReplicaSpecs"
    if not isinstance(specs, dict):
        return [Refusal(base, "Required value: must be required", rule)]
    out = []
    for role, rs in specs.items():
        rs = rs if isinstance(rs, dict) else {}
        where = f"{base}[{role}]"
        containers = ((rs.get("template") or {}).get("spec") or {}).get("containers") or []
        if role not in ("Master", "Worker"):
            out.append(Refusal(where, f'Unsupported value: "{role}": supported values: "Master", "Worker"', rule))
        if not containers:
            out.append(Refusal(f"{where}.template.spec.containers", "Required value: must be specified", rule))
        for i, c in enumerate(containers):
            if not (c or {}).get("image"):
                out.append(Refusal(f"{where}.template.spec.containers[{i}].image", "Required value: must be required",
                                   rule))
        if not any((c or {}).get("name") == "pytorch" for c in containers):
            out.append(Refusal(f"{where}.template.spec.containers", "Required value: must have at least one "
                               "container with name pytorch", rule))
        if role == "Master" and rs.get("replicas") != 1:
            out.append(Refusal(f"{where}.replicas", "Forbidden: must be 1", rule))
    return out


# the runtimes this module knows: replicated job -> its containers (kubeflow/trainer v2.3.0
# manifests/base/runtimes/torch_distributed.yaml: one 'node' job whose container is 'node')
KNOWN_RUNTIMES = {("ClusterTrainingRuntime", "torch-distributed"): {"node": {"node"}}}
RUNTIME_KINDS = ("ClusterTrainingRuntime", "TrainingRuntime")
TORCHRUN_RESERVED_ENV = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")


def trainjob_refusals(job: dict) -> list[Refusal]:
    """Trainer v2.3.0's TrainJob validator: a registered runtime kind, then the torch plugin (no torchrun-reserved
    env) and the jobset plugin (runtime patches: a domain-prefixed manager; jobs and containers the runtime has;
    no env on the node container; initializers need their runtime jobs)."""
    spec = job.get("spec") or {}
    ref = spec.get("runtimeRef") or {}
    if ref.get("apiGroup") != "trainer.kubeflow.org" or ref.get("kind") not in RUNTIME_KINDS:
        return [Refusal("spec.runtimeRef", f"unsupported runtime: {ref.get('kind')}.{ref.get('apiGroup')}",
                        f"{TRAINER}: runtime registry")]
    out = []
    reserved = sorted({e.get("name") for e in (spec.get("trainer") or {}).get("env") or []} &
                      set(TORCHRUN_RESERVED_ENV))
    if reserved:
        out.append(Refusal("spec.trainer.env", f"must not have reserved envs, invalid envs configured: {reserved}",
                           f"{TRAINER}: torch plugin"))
    runtime = KNOWN_RUNTIMES.get((ref.get("kind"), ref.get("name")))
    for i, patch in enumerate(spec.get("runtimePatches") or []):
        out += runtime_patch_refusals(i, patch, runtime)
    if runtime is not None:
        for init in ("dataset", "model"):
            if ((spec.get("initializer") or {}).get(init)) and f"{init}-initializer" not in runtime:
                out.append(Refusal("spec.runtimeRef", f"must have {init}-initializer job when trainJob is "
                                   f"configured with input {init}Config", f"{TRAINER}: jobset plugin"))
    return out


def runtime_patch_refusals(i: int, patch: dict, runtime: dict | None) -> list[Refusal]:
    where, rule = f"spec.runtimePatches[{i}]", f"{TRAINER}: jobset plugin"
    out = []
    manager = str(patch.get("manager", ""))
    if problem := domain_prefixed_path_error(manager):
        out.append(Refusal(f"{where}.manager", f"{manager!r}: {problem}", f"{rule} IsDomainPrefixedPath"))
    if runtime is None:
        return out
    jobs = (((patch.get("trainingRuntimeSpec") or {}).get("template") or {}).get("spec") or {}).get("replicatedJobs")
    for rj in jobs or []:
        if rj.get("name") not in runtime:
            out.append(Refusal(where, "must not have replicated job that doesn't exist in the runtime job template "
                               f"({rj.get('name')!r})", rule))
            continue
        pod = (((rj.get("template") or {}).get("spec") or {}).get("template") or {}).get("spec") or {}
        for c in (pod.get("initContainers") or []) + (pod.get("containers") or []):
            if c.get("name") not in runtime[rj["name"]]:
                out.append(Refusal(where, f"must not have container that doesn't exist in the runtime job "
                                   f"{rj['name']} ({c.get('name')!r})", rule))
            elif c.get("env") and c.get("name") in ("dataset-initializer", "model-initializer", "node"):
                out.append(Refusal(where, "must not have envs for the dataset-initializer, model-initializer, node "
                                   "containers", rule))
    return out


def domain_prefixed_path_error(value: str) -> str | None:
    """apimachinery's IsDomainPrefixedPath: '<DNS-1123 subdomain>/<HTTP path>' (e.g. 'acme.io/foo')."""
    if not value:
        return "Required value"
    host, sep, path = value.partition("/")
    if not sep or not host or not path:
        return 'must be a domain-prefixed path (such as "acme.io/foo")'
    if not _subdomain(host):
        return f"{host!r} must be a lowercase RFC 1123 subdomain"
    if not HTTP_PATH.fullmatch(path):
        return f"Invalid path: {path!r}"
    return None
