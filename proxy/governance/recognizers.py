"""Presidio recognizers adapted for agent traffic, speed and offline use.

Defined on first use (`recognizer_classes`): Presidio is imported only inside the Redactor's
`_without_torch`, so the classes cannot be defined at import time.
"""

from __future__ import annotations

from typing import Any

from proxy.governance.secrets import _DECIMAL, _phone_windows, card_scheme_ok, digit_groups, has_phone_context

_CLASSES: tuple[Any, Any, Any] | None = None


def recognizer_classes() -> tuple[Any, Any, Any]:
    global _CLASSES
    if _CLASSES is None:
        _CLASSES = _define_recognizers()
    return _CLASSES


def _define_recognizers() -> tuple[Any, Any, Any]:
    import phonenumbers
    import tldextract
    from presidio_analyzer import EntityRecognizer, RecognizerResult
    from presidio_analyzer.predefined_recognizers import (
        CreditCardRecognizer,
        EmailRecognizer,
        PhoneRecognizer,
    )

    # The bundled public suffix snapshot, no fetch, no cache directory.
    extractor = tldextract.TLDExtract(suffix_list_urls=(), cache_dir=None, fallback_to_snapshot=True)
    formats = (phonenumbers.PhoneNumberFormat.INTERNATIONAL, phonenumbers.PhoneNumberFormat.NATIONAL)

    class OfflineEmailRecognizer(EmailRecognizer):
        def validate_result(self, pattern_text: str) -> bool:
            return extractor(pattern_text).fqdn != ""

    class SchemeCreditCardRecognizer(CreditCardRecognizer):
        """Luhn alone passes one digit run in ten (epoch milliseconds, ids); a card also starts with a
        real scheme's prefix and has that scheme's length."""

        def validate_result(self, pattern_text: str) -> bool:
            digits = "".join(c for c in pattern_text if c.isdigit())
            return card_scheme_ok(digits) and bool(super().validate_result(pattern_text))

    class AgentPhoneRecognizer(PhoneRecognizer):
        """python-phonenumbers (as Presidio's recognizer), stricter about what counts as written as a
        phone number. phonenumbers at leniency VALID accepts any digit run a region's numbering plan
        allows: `4-5-20251001` inside a model id, epoch seconds, `31 2019 -0700` from a git date. So a
        match must stand alone (not glued into an identifier) and either be written the way phone
        numbers are written (E.164 `+14155550132`, or the digit grouping of the number's international
        or national format: `+1 415-555-0132`, `(415) 555-0132`) or come with a phone word before it
        or as its JSON key. python-phonenumbers over the whole text costs ~5 ms/KB (eight regions); it
        only ever matches digit runs, so it is given the runs with a little margin."""

        SCORE = 0.6

        def analyze(self, text, entities, nlp_artifacts=None):  # type: ignore[override]
            return self.find(text, None)

        def find(self, text: str, key: str | None) -> list[Any]:
            results = []
            for ws, we in _phone_windows(text, key):
                window = text[ws:we]
                for region in self.supported_regions:
                    for match in phonenumbers.PhoneNumberMatcher(window, region, leniency=self.leniency):
                        start, end = match.start + ws, match.end + ws
                        if self._written_as_phone(text, start, match.raw_string, match.number, key):
                            results.append(RecognizerResult("PHONE_NUMBER", start, end, self.SCORE))
            return EntityRecognizer.remove_duplicates(results)

        @staticmethod
        def _written_as_phone(text: str, start: int, raw: str, number: Any, key: str | None) -> bool:
            if raw[:1] == "+" and raw[1:2].isspace():  # `x + 672353541`: arithmetic, not a prefix
                return False
            if _DECIMAL.fullmatch(raw):  # `16.498936`: a decimal number
                return False
            if has_phone_context(text, start, key):
                return True
            groups = digit_groups(raw)
            if len(groups) == 1:
                return raw.startswith("+")  # E.164; a bare digit run needs a phone word
            if sum(groups) < len(str(number.national_number)):
                return False
            return any(digit_groups(phonenumbers.format_number(number, f))[-len(groups):] == groups
                       for f in formats)

    return OfflineEmailRecognizer, AgentPhoneRecognizer, SchemeCreditCardRecognizer
