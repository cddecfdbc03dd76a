"""The answers kvgate writes as wire bytes (extproc.encoded) are the ones protobuf builds."""

from __future__ import annotations

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc import answers, encoded
from extproc.gate import METADATA_NAMESPACE
from extproc.service import encode_response


def _built(headers: list[tuple[str, str]]) -> pb.HeaderMutation:
    mutation = pb.HeaderMutation(remove_headers=["content-length"])
    for key, value in headers:
        option = mutation.set_headers.add()
        option.header.key = key
        option.header.raw_value = value.encode()
        option.append_action = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
    return mutation


def test_set_headers_writes_what_protobuf_builds() -> None:
    cases = [
        [("x-ratelimit-limit-requests", "64"), ("x-ratelimit-remaining-tokens", "9999999999663")],
        # Lengths of 127 and 128 bytes (a varint of one byte, then two), a multi-byte UTF-8
        # value, an empty one, a long one, the same key twice (both kept, in order).
        [("k", "v" * 127), ("k", "v" * 128), ("x-é", "ü" * 70), ("empty", ""),
         ("x" * 300, "y" * 20_000), ("a", "1"), ("a", "2")],
    ]
    for headers in cases:
        for _ in range(2):  # encoded, then from the cache
            mutation = pb.HeaderMutation(remove_headers=["content-length"])
            answers.set_headers(mutation, headers)
            assert mutation == _built(headers)
            assert mutation.SerializeToString() == _built(headers).SerializeToString()


def test_the_option_cache_stays_bounded() -> None:
    for n in range(encoded._CACHE_MAX + 10):
        mutation = pb.HeaderMutation()
        answers.set_headers(mutation, [("x-ratelimit-remaining-tokens", str(n))])
        assert mutation.set_headers[0].header.raw_value == str(n).encode()
    assert len(encoded._OPTIONS) <= encoded._CACHE_MAX


def test_response_headers_answer_is_what_protobuf_builds() -> None:
    cases = [[("x-ratelimit-limit-requests", "64"), ("x-ratelimit-reset-requests", "0s")],
             # The answer's lengths past one varint byte, then past the table of varints.
             [("k", "v" * 200), ("x-é", "ü" * 70)], [("x" * 300, "y" * 5000)], []]
    for headers in cases:
        for drop_length in (False, True):
            built = pb.ProcessingResponse()
            mutation = built.response_headers.response.header_mutation
            mutation.CopyFrom(_built(headers))
            if not drop_length:
                del mutation.remove_headers[:]
            got = encoded.response_headers(headers, drop_length)
            assert got == built.SerializeToString()
            assert pb.ProcessingResponse.FromString(got) == built


def test_body_answer_with_metadata_is_what_protobuf_builds() -> None:
    cases = [[("link", "a1b2c3-17")], [("link", "x" * 130), ("x-ratelimit-limit-requests", "64")],
             [("k", "é" * 3000)], [("k", "1"), ("k", "2")]]
    for metadata in cases:
        built = pb.ProcessingResponse()
        built.request_body.SetInParent()
        fields = built.dynamic_metadata.fields[METADATA_NAMESPACE].struct_value.fields
        for key, value in metadata:
            fields[key].string_value = value
        got = answers.body_answer(None, None, metadata)
        if len(metadata) == 1:  # the link alone: wire bytes, written as they are
            assert got == built.SerializeToString()
        wire = encode_response(got)
        assert pb.ProcessingResponse.FromString(wire) == built
        assert pb.ProcessingResponse.FromString(wire).SerializeToString(deterministic=True) == \
            built.SerializeToString(deterministic=True)


def test_the_constant_answers_are_what_protobuf_builds() -> None:
    for name, phase, kind in [("CONTINUE_REQUEST_HEADERS", "request_headers", pb.HeadersResponse),
                              ("CONTINUE_REQUEST_BODY", "request_body", pb.BodyResponse),
                              ("CONTINUE_RESPONSE_HEADERS", "response_headers", pb.HeadersResponse),
                              ("CONTINUE_RESPONSE_BODY", "response_body", pb.BodyResponse),
                              ("CONTINUE_REQUEST_TRAILERS", "request_trailers", pb.TrailersResponse),
                              ("CONTINUE_RESPONSE_TRAILERS", "response_trailers", pb.TrailersResponse)]:
        built = pb.ProcessingResponse(**{phase: kind()})
        assert getattr(encoded, name) == built.SerializeToString()
        assert pb.ProcessingResponse.FromString(getattr(encoded, name)).WhichOneof("response") == phase


def test_the_serializer_writes_bytes_as_they_are_and_serializes_messages() -> None:
    assert encode_response(encoded.CONTINUE_RESPONSE_BODY) is encoded.CONTINUE_RESPONSE_BODY
    message = answers.PASS_THROUGH_BODY
    assert encode_response(message) == message.SerializeToString()
