# Project-wide CMake functions.

# Adds every immediate subfolder of the current folder that has a CMakeLists.txt, in name order.
# Areas (kernels/mla, kernels/moe, coordinator/tokenizer, ...) plug in by creating that file.
function(mlaserve_add_subdirectories)
  file(GLOB children LIST_DIRECTORIES true CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/*)
  list(SORT children)
  foreach(child IN LISTS children)
    if(IS_DIRECTORY ${child} AND EXISTS ${child}/CMakeLists.txt)
      add_subdirectory(${child})
    endif()
  endforeach()
endfunction()

# mlaserve_add_test(NAME name SOURCES a.cc ... LIBS lib ... LABELS core ... [TIMEOUT s])
# Builds a GoogleTest executable and registers it with CTest under the given labels.
function(mlaserve_add_test)
  cmake_parse_arguments(T "" "NAME;TIMEOUT" "SOURCES;LIBS;LABELS" ${ARGN})
  add_executable(${T_NAME} ${T_SOURCES})
  target_link_libraries(${T_NAME} PRIVATE ${T_LIBS} GTest::gtest GTest::gtest_main)
  add_test(NAME ${T_NAME} COMMAND ${T_NAME} WORKING_DIRECTORY ${CMAKE_CURRENT_SOURCE_DIR})
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 600)
  endif()
  # MLASERVE_SANITIZER_ENVIRONMENT: the sanitizers' options in an MLASERVE_SANITIZE build.
  set(env MLASERVE_SOURCE_DIR=${PROJECT_SOURCE_DIR} MLASERVE_BINARY_DIR=${PROJECT_BINARY_DIR}
    ${MLASERVE_SANITIZER_ENVIRONMENT})
  set_tests_properties(${T_NAME} PROPERTIES LABELS "${T_LABELS}" TIMEOUT ${T_TIMEOUT}
    ENVIRONMENT "${env}")
endfunction()
