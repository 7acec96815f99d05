"""Forms of the site: sign-up, submission, drafter edit, API token."""
from __future__ import annotations

from django import forms
from django.contrib.auth.forms import UserCreationForm

from .models import Drafter, Protocol, Target
from .services.submissions import EDITABLE_FIELDS


class MultipleFileInput(forms.ClearableFileInput):
    allow_multiple_selected = True


class MultipleFileField(forms.FileField):
    """Several files in one input (Django's documented pattern)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("widget", MultipleFileInput())
        super().__init__(*args, **kwargs)

    def clean(self, data, initial=None):
        if not data:
            return super().clean(None, initial) or []
        items = data if isinstance(data, (list, tuple)) else [data]
        return [super(MultipleFileField, self).clean(d, initial) for d in items]


class SignupForm(UserCreationForm):
    email = forms.EmailField(required=False, help_text="Optional; only staff see it.")

    class Meta(UserCreationForm.Meta):
        fields = ("username", "email")


def _claims_need_source(form, cleaned):
    claimed = (cleaned.get("claimed_acceptance_length") is not None
               or cleaned.get("claimed_speedup") is not None)
    if claimed and not cleaned.get("claimed_source"):
        form.add_error("claimed_source", "Give the URL where these figures are published "
                                         "(paper, model card), or leave the claims empty.")


class ProtocolSelect(forms.Select):
    """Each option names its target (data-target), so the page can offer only the
    protocols of the chosen target."""

    def create_option(self, name, value, label, selected, index, subindex=None, attrs=None):
        option = super().create_option(name, value, label, selected, index, subindex, attrs)
        instance = getattr(value, "instance", None)
        if instance is not None:
            option["attrs"]["data-target"] = str(instance.target_id)
            option["attrs"]["data-ks"] = ",".join(str(k) for k in instance.spec.ks)
        return option


class ProtocolChoiceField(forms.ModelChoiceField):
    widget = ProtocolSelect

    def label_from_instance(self, p):
        return (f"{p.slug} v{p.version} \u2014 {p.target.name}, {p.engine} on {p.hardware}, "
                f"k in {list(p.spec.ks)}")


class SubmitForm(forms.Form):
    target = forms.ModelChoiceField(Target.objects.order_by("name"), empty_label=None,
                                    help_text="The model the drafter speeds up.")
    protocol = ProtocolChoiceField(
        Protocol.objects.select_related("target").order_by("-created_at", "-version"),
        empty_label=None, help_text="The measurement protocol (its target must be the one above).")
    method = forms.ChoiceField(choices=Drafter.METHODS)
    name = forms.CharField(max_length=200)
    description = forms.CharField(widget=forms.Textarea(attrs={"rows": 3}), required=False)
    link = forms.URLField(required=False, assume_scheme="https",
                          help_text="Code, paper or model card.")
    licence = forms.CharField(max_length=100, required=False,
                              help_text="e.g. Apache-2.0, MIT, CC-BY-4.0.")
    claimed_acceptance_length = forms.FloatField(
        required=False, min_value=1.0, label="Claimed acceptance length",
        help_text="As published (AL = 1 + accepted / drafts), optional.")
    claimed_speedup = forms.FloatField(required=False, min_value=0.0, label="Claimed speedup",
                                       help_text="As published, optional.")
    claimed_source = forms.URLField(required=False, assume_scheme="https",
                                    label="Source of the claims")
    k = forms.TypedChoiceField(
        required=False, coerce=int, empty_value=None, label="Speculation budget k",
        help_text="Optional: the budget you recommend, checked against the protocol's. Every "
                  "budget of the protocol is measured; the drafter page opens at the best one.")
    prompt_lookup_min = forms.IntegerField(required=False, label="n-gram min",
                                           help_text="ngram only: 1-16.",
                                           widget=forms.NumberInput(attrs={"placeholder": "2"}))
    prompt_lookup_max = forms.IntegerField(required=False, label="n-gram max",
                                           help_text="ngram only: 1-16, at least the min.",
                                           widget=forms.NumberInput(attrs={"placeholder": "4"}))
    files = MultipleFileField(
        required=False, label="Checkpoint files",
        help_text="config.json plus *.safetensors (or pytorch_model.bin, medusa_lm_head.pt) "
                  "as several files, or one .zip / .tar.gz. No files for ngram.")
    hub_reference = forms.CharField(
        required=False, max_length=300, label="Or a model-hub reference",
        help_text="owner/name, or owner/name@revision (a branch, a tag or a commit hash), "
                  "instead of files: the revision is pinned to its commit, which is what "
                  "is measured.",
        widget=forms.TextInput(attrs={"placeholder": "RedHatAI/Llama-3.1-8B-Instruct-speculator.eagle3@main"}))

    PARAM_FIELDS = ("k", "prompt_lookup_min", "prompt_lookup_max")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        protocols = list(self.fields["protocol"].queryset)
        ks = sorted({k for p in protocols for k in p.spec.ks})
        self.fields["k"].choices = [("", "all of the protocol's")] + [(k, k) for k in ks]
        if protocols and not self.is_bound:
            self.initial.setdefault("protocol", protocols[0].pk)
            self.initial.setdefault("target", protocols[0].target_id)

    def clean(self):
        cleaned = super().clean()
        protocol, target = cleaned.get("protocol"), cleaned.get("target")
        if protocol and target and protocol.target_id != target.pk:
            self.add_error("protocol", f"{protocol.slug} v{protocol.version} measures "
                                       f"{protocol.target.name}, not {target.name}: choose a "
                                       "protocol for that target")
        k = cleaned.get("k")
        if protocol and k is not None and k not in protocol.spec.ks:
            self.add_error("k", f"this protocol measures k in {list(protocol.spec.ks)}")
        _claims_need_source(self, cleaned)
        if cleaned.get("files") and cleaned.get("hub_reference"):
            self.add_error("hub_reference", "Give the files or a hub reference, not both.")
        return cleaned

    def params(self) -> dict:
        return {f: self.cleaned_data.get(f) for f in self.PARAM_FIELDS
                if self.cleaned_data.get(f) is not None}

    def add_problems(self, problems):
        """Put each refusal next to its field: parameters next to theirs, file problems
        next to the file input (naming file, member and field), the rest on top."""
        for p in problems:
            if p.file == "params" and p.field in self.fields:
                self.add_error(p.field, p.message)
            elif p.file == "(hub)" and p.field == "hub_reference":
                self.add_error("hub_reference", p.message)
            elif p.file in ("(submission)",):
                self.add_error(None, f"{p.field}: {p.message}")
            else:
                self.add_error("files", f"{p.where} \u2014 {p.field}: {p.message}")


class DrafterEditForm(forms.ModelForm):
    link = forms.URLField(required=False, assume_scheme="https")
    claimed_source = forms.URLField(required=False, assume_scheme="https",
                                    label="Source of the claims")

    class Meta:
        model = Drafter
        fields = EDITABLE_FIELDS
        widgets = {"description": forms.Textarea(attrs={"rows": 4})}

    def clean(self):
        cleaned = super().clean()
        _claims_need_source(self, cleaned)
        return cleaned


class TokenForm(forms.Form):
    name = forms.CharField(max_length=100, required=False,
                           help_text="A label, e.g. the machine that uses it.")
